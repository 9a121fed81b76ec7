"""Several processes: data-parallel gradients and collectives (distributed.py), FSDP2 (sharding.py)."""
