"""The CPU kernels: C files beside the Python that builds (``_cc``) and calls each one."""
