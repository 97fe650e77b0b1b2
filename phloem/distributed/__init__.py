"""phloem.distributed: tensor parallelism (Megatron-LM, Shoeybi et al. 2019, §3): the ranks' state, their collectives and the worker processes."""
