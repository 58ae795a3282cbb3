"""Build and install sntf.

The two native libraries are compiled with g++ against the TensorFlow that is
already installed in the target environment (their ABI is tied to it), so
install without build isolation:

    pip install --no-build-isolation -e .

  * sntf/_sntf_ops.so   custom ops (SnSwapOut/SnSwapIn, SnCacheOut/SnCacheIn,
                        SnDeviceBytesLimit, SnTensorMemoryType) and the host
                        tensor pool, loaded with tf.load_op_library;
  * sntf/_plugin*.so    the Grappler plugin shim: a pybind11 module that also
                        exports TF_InitGraph and links libtensorflow_cc.so.2.
"""

import os
import subprocess
import sys
import sysconfig

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

TF_REQUIREMENT = "tensorflow>=2.21,<2.22"
HERE = os.path.dirname(os.path.abspath(__file__))


def _tensorflow_flags():
    """Compile and link flags of the installed TensorFlow."""
    try:
        import tensorflow as tf
    except ImportError as e:  # pragma: no cover - a build-environment error
        raise RuntimeError(
            "sntf compiles against the installed TensorFlow; install "
            f"'{TF_REQUIREMENT}' first and build with --no-build-isolation"
        ) from e
    lib_dir = os.path.dirname(tf.__file__)
    compile_flags = list(tf.sysconfig.get_compile_flags())
    link_flags = list(tf.sysconfig.get_link_flags())
    link_flags += [f"-Wl,-rpath,{lib_dir}"]
    return compile_flags, link_flags, lib_dir


class NativeExtension(Extension):
    """A shared library built by one g++ command."""

    def __init__(self, name, sources, kind):
        super().__init__(name, sources=sources)
        self.kind = kind  # "ops" or "plugin"


class BuildNative(build_ext):
    """Compiles the native libraries with g++ and TensorFlow's own flags."""

    def build_extension(self, ext):
        compile_flags, link_flags, tf_lib_dir = _tensorflow_flags()
        output = self.get_ext_fullpath(ext.name)
        os.makedirs(os.path.dirname(output), exist_ok=True)
        # -w: TensorFlow's headers emit thousands of deprecation warnings.
        command = ["g++", "-shared", "-fPIC", "-O2", "-w", "-std=c++17"]
        command += compile_flags
        command += ["-I" + os.path.join(HERE, "tf_ops")]
        if ext.kind == "plugin":
            import pybind11

            command += ["-I" + pybind11.get_include(),
                        "-I" + sysconfig.get_paths()["include"],
                        "-fvisibility=hidden"]
        command += [os.path.join(HERE, s) for s in ext.sources]
        command += ["-o", output] + link_flags
        if ext.kind == "plugin":
            # The TF_* grappler symbols live in libtensorflow_cc.so.2.
            command += ["-L" + tf_lib_dir, "-l:libtensorflow_cc.so.2"]
        print(" ".join(command))
        subprocess.check_call(command)


setup(
    name="sntf",
    version="0.1.0",
    description="Superneurons-style memory management for TensorFlow 2",
    packages=find_packages(include=["sntf", "sntf.*"]),
    python_requires=">=3.10",
    install_requires=[TF_REQUIREMENT, "numpy", "absl-py"],
    ext_modules=[
        NativeExtension(
            "sntf._sntf_ops",
            ["tf_ops/swap_ops.cc", "tf_ops/tensor_cache.cc",
             "tf_ops/swap_common.cc", "tf_ops/test_copier.cc",
             "tf_ops/device_ops.cc", "tf_ops/gpu_pinning.cc",
             "tf_ops/cuda_runtime_pinning.cc", "tf_ops/host_pool.cc",
             "tf_ops/host_pool_capi.cc"],
            kind="ops"),
        NativeExtension("sntf._plugin", ["tf_ops/plugin.cc"], kind="plugin"),
    ],
    cmdclass={"build_ext": BuildNative},
    zip_safe=False,
)
