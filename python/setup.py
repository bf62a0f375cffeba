"""Builds mixattn's PyTorch CPU extension against the installed PyTorch.

    /usr/bin/python3 -m venv DIR && DIR/bin/python -m pip install torch==2.13.0
    DIR/bin/python -m pip install --no-build-isolation ./python      (python/venv.sh does both)

The C++ library is header-only and lives next to this folder (../include); it is compiled into
the extension, not installed. Compiler flags: -O3, OpenMP (PyTorch's intra-op pool runs the
(batch, head) pairs), Eigen single-threaded inside each pair, and an instruction-set flag:
-march=native by default, since the extension is built on the machine that runs it. Set
MIXATTN_TORCH_ARCH to another flag (e.g. "-march=x86-64-v3") to build for other machines, or to
"" for the compiler's baseline. MAX_JOBS bounds parallel compilation (PyTorch's ninja build).
MIXATTN_TORCH_SANITIZE (e.g. "address,undefined") builds it under the compiler's sanitizers.
"""

import os
import re

from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

here = os.path.dirname(os.path.abspath(__file__))
library_include = os.path.join(os.path.dirname(here), "include")
if not os.path.isfile(os.path.join(library_include, "mixattn", "gma.hpp")):
    raise RuntimeError(f"mixattn's headers are not at {library_include}: build this package "
                       "from a checkout of the repository (pip install ./python)")


def library_version():
    """The library's version, defined once, in include/mixattn/core.hpp."""
    with open(os.path.join(library_include, "mixattn", "core.hpp")) as f:
        parts = dict(re.findall(r"^#define MIXATTN_VERSION_(MAJOR|MINOR|PATCH) +([0-9]+)$",
                                f.read(), re.M))
    if len(parts) != 3:
        raise RuntimeError("include/mixattn/core.hpp does not define MIXATTN_VERSION_MAJOR, "
                           "_MINOR and _PATCH")
    return f"{parts['MAJOR']}.{parts['MINOR']}.{parts['PATCH']}"


arch = os.environ.get("MIXATTN_TORCH_ARCH", "-march=native").split()
cxx_flags = ["-std=c++17", "-O3", "-g0", "-fopenmp", "-DEIGEN_DONT_PARALLELIZE"] + arch
link_flags = ["-fopenmp"]
build_base = "build"
# MIXATTN_TORCH_SANITIZE=address,undefined (tests/sanitize.sh): the extension under the compiler's
# sanitizers, -O0 with frame pointers, built in its own directory (build/sanitize) so that it
# never mixes objects with the normal build. -O0 rather than -O1: g++ compiles the two operator
# files (csrc/gma_kernels.cpp, csrc/ovq_kernels.cpp) under ASan+UBSan in about a third of the time
# (64 and 71 s against 228 and 208 s), which outweighs the slower tests, and nothing is optimised
# away before it is checked. The interpreter must then preload the runtime
# (LD_PRELOAD=$(c++ -print-file-name=libasan.so)).
sanitize = os.environ.get("MIXATTN_TORCH_SANITIZE", "")
if sanitize:
    flags = [f"-fsanitize={sanitize}", "-fno-sanitize-recover=all", "-fno-omit-frame-pointer"]
    cxx_flags = [f for f in cxx_flags if f not in ("-O3", "-g0")] + ["-O0", "-g1"] + flags
    link_flags += flags
    build_base = os.path.join("build", "sanitize")

setup(
    name="mixattn",
    version=library_version(),
    description="Gaussian Mixture and Online VQ attention for PyTorch on CPU (mixattn's kernels)",
    packages=["mixattn"],
    ext_modules=[
        CppExtension(
            name="mixattn._C",
            sources=[os.path.join("csrc", f) for f in
                     ("ops.cpp", "bindings.cpp", "caches.cpp", "gma_kernels.cpp", "ovq_kernels.cpp",
                      "flash_kernels.cpp", "baseline_kernels.cpp", "delta_kernels.cpp")],
            include_dirs=[library_include, "/usr/include/eigen3"],
            extra_compile_args={"cxx": cxx_flags},
            extra_link_args=link_flags,
        )
    ],
    cmdclass={"build_ext": BuildExtension},
    options={"build": {"build_base": build_base}},
)
