#!/bin/bash
# On the GPU machine, in a run that carries .gpu/d1, .gpu/d2 or .gpu/d3 (bench/gpu/prepare_demo.sh): keeps the parts
# in $PARK (/tmp/kit/demo), which lives as long as the machine stays warm.
set -e
PARK=${PARK:-/tmp/kit/demo}
mkdir -p "$PARK"
for d in .gpu/d1 .gpu/d2 .gpu/d3; do if [ -d $d ]; then cp -r $d/. "$PARK"/; fi; done
ls "$PARK" | tr '\n' ' '; echo
