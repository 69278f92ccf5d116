"""The prefix cache: the RAM tier, the disk tier, KV serialization and quantization."""
