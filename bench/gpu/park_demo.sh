#!/bin/bash
# On the GPU machine, in a run that carries .gpu/d1, .gpu/d2 or .gpu/d3 (bench/gpu/prepare_demo.sh): keeps the parts
# in /tmp/kit/demo, which lives as long as the machine stays warm.
set -e
mkdir -p /tmp/kit/demo
for d in .gpu/d1 .gpu/d2 .gpu/d3; do [ -d $d ] && cp $d/* /tmp/kit/demo/; done
ls /tmp/kit/demo | tr '\n' ' '; echo
