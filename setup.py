"""Build of kvstore's Cython I/O core.

The `.pyx`/`.pxd` sources live in cython_src/kvstore/ (mirroring the package path, so
cross-module cimports resolve); generated C goes to build/cython and is never committed or
installed. Nothing is linked: liburing's non-inline functions are reached through the
`liburing` binding's Cython capsules, its static-inline helpers compile in from its header.
The slot codec compiles xxHash in from its header (Debian `libxxhash-dev`; an AVX2 build of
XXH3 in csrc/, hand-written C, is picked at run time) and links zlib for CRC-32
(`zlib1g-dev`); `make` installs both. The CUDA driver is never linked either: `_cuda`
dlopens libcuda.so.1 at run time, so the build needs no CUDA toolkit and the same build
runs with or without a GPU.
"""
import os

from setuptools import Extension, setup


def _require_header(name: str, package: str) -> None:
    import sysconfig
    dirs = ["/usr/include", "/usr/local/include", sysconfig.get_config_var("INCLUDEDIR") or ""]
    dirs += [d for d in os.environ.get("CPATH", "").split(":") if d]
    if not any(os.path.exists(os.path.join(d, name)) for d in dirs):
        raise SystemExit(f"kvstore build: {name} not found; install it first "
                         f"(Debian/Ubuntu: apt-get install {package}; or set CPATH)")


def extensions():
    _require_header("xxhash.h", "libxxhash-dev")
    _require_header("zlib.h", "zlib1g-dev")
    import liburing
    import numpy
    from Cython.Build import cythonize

    include_dirs = [os.path.join(os.path.dirname(liburing.__file__), "include"), numpy.get_include()]
    names = ["_hostbuf", "_sharedmap", "_keytable", "_seenfilter", "_ring", "_slotfile", "_cuda", "_copy"]
    exts = [
        Extension(
            f"kvstore.{name}",
            [os.path.join("cython_src", "kvstore", f"{name}.pyx")]
            + ([os.path.join("csrc", "kvstore_xxh3_avx2.c")] if name == "_slotfile" else []),
            include_dirs=include_dirs + ["csrc"],
            define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")]
            + ([("XXH_INLINE_ALL", None)] if name in ("_keytable", "_seenfilter") else []),
            libraries={"_slotfile": ["z"], "_cuda": ["dl"]}.get(name, []),
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
