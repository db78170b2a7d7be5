"""Build of kvstore's Cython I/O core.

The `.pyx`/`.pxd` sources live in cython_src/kvstore/ (mirroring the package path, so
cross-module cimports resolve); generated C goes to build/cython and is never committed or
installed. Nothing is linked: liburing's non-inline functions are reached through the
`liburing` binding's Cython capsules, its static-inline helpers compile in from its header.
"""
import os

from setuptools import Extension, setup


def extensions():
    import liburing
    import numpy
    from Cython.Build import cythonize

    include_dirs = [os.path.join(os.path.dirname(liburing.__file__), "include"), numpy.get_include()]
    names = ["_hostbuf", "_ring", "_slotfile"]
    exts = [
        Extension(
            f"kvstore.{name}",
            [os.path.join("cython_src", "kvstore", f"{name}.pyx")],
            include_dirs=include_dirs,
            define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
            extra_compile_args=["-O2", "-Wno-unused-function", "-Wno-unreachable-code"],
        )
        for name in names
    ]
    return cythonize(
        exts,
        include_path=["cython_src"],
        build_dir=os.path.join("build", "cython"),
        compiler_directives={"language_level": 3, "boundscheck": False, "wraparound": False},
    )


setup(ext_modules=extensions())
