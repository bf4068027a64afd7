"""The kernels themselves (imported on first use: importing numba.cuda is slow).

``cuda`` must be a module global here: numba's simulator swaps the global
``cuda`` of kernel functions for its fake module.
"""
from numba import cuda


@cuda.jit
def touch_kernel(arr, stride, value):
    # Page i gets one write, at element i*stride (stride = page/itemsize); grid-stride
    # over pages, since the grid is capped at MAX_BLOCKS blocks.
    pages = (arr.shape[0] + stride - 1) // stride
    for i in range(cuda.grid(1), pages, cuda.gridsize(1)):
        j = i * stride
        arr[j] = arr[j] + value


@cuda.jit
def triad_kernel(a, b, c, scalar):
    start = cuda.grid(1)
    step = cuda.gridsize(1)
    for i in range(start, a.shape[0], step):
        a[i] = b[i] + scalar * c[i]


@cuda.jit
def copy_kernel(dst, src):
    start = cuda.grid(1)
    step = cuda.gridsize(1)
    for i in range(start, dst.shape[0], step):
        dst[i] = src[i]
