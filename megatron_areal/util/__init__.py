"""Small helpers with no place of their own, shared across parts: free ports (``netutil``), the dtype a
device computes in (``compute_dtype``), returning freed memory to the system after a step (``heap``).
They import nothing of the package.
"""
