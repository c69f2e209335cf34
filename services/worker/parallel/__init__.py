"""Tensor parallelism: one worker as N ranks on one node (docs/tensor-parallel.md).

Only rank 0 samples, on logits gathered whole, so the tokens do not depend on N.

    group.py         the process group (gloo on CPU, NCCL on CUDA), its timeout, collectives
    partition.py     which heads, rows and vocabulary entries each rank owns; refusals
    linear.py        column- and row-parallel linears (q/k/v and gate/up fused)
    vocab.py         the vocabulary-parallel embedding and lm_head (gathered logits)
    checkpoint.py    each rank reads only its slices of the safetensors
    step_channel.py  rank 0's step inputs to the other ranks, as int64 tensors
    launch.py        starting the other ranks, and going down together when one dies
"""
