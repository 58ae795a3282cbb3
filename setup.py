"""Build and install sntf.

The native libraries are compiled with g++ against the TensorFlow that is
already installed in the target environment (the first two link it, and their
ABI is tied to it), so install without build isolation:

    pip install --no-build-isolation -e .

  * sntf/_sntf_ops.so   custom ops (SnSwapOut/SnSwapIn, SnCacheOut/SnCacheIn,
                        SnDeviceBytesLimit, SnTensorMemoryType,
                        SnReserveRegion) and the host tensor pool, loaded
                        with tf.load_op_library;
  * sntf/_plugin*.so    the Grappler plugin shim: a pybind11 module that also
                        exports TF_InitGraph and links libtensorflow_cc.so.2;
  * sntf/_bfc_model*.so the allocator model's step (sntf.analysis.bfc), a
                        pybind11 module without TensorFlow;
  * sntf/_graph_walks*.so the index's topological order and the executor's
                        order (sntf.graph.index, sntf.analysis.schedule),
                        a pybind11 module without TensorFlow.

It also installs sntf-startup.pth into site-packages, a one-line startup
hook (see sntf_startup.py) that makes `SNTF_BUDGET=12GB python train.py`
work without `import sntf`: for a wheel, an editable install and the legacy
`setup.py develop` alike. The install puts the dump tool on the PATH as
`sntf-dump` (sntf.tools.dump:main); the extra "plot" adds matplotlib, which
draws the tool's timeline.png.
"""

import concurrent.futures
import importlib.util
import os
import subprocess
import sys
import sysconfig

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext
from setuptools.command.build_py import build_py
from setuptools.command.develop import develop

# The releases benchmarks/tf_versions.sh builds and smoke-tests.
TF_REQUIREMENT = "tensorflow>=2.19,<2.22"
# Commands the install puts on the PATH: the dump tool (also tools/sntf_dump
# in a clone).
ENTRY_POINTS = {"console_scripts": ["sntf-dump = sntf.tools.dump:main"]}
# Optional extras: `pip install --no-build-isolation ".[plot]"` adds what the
# dump tool draws its timeline.png with; without it the tool writes the same
# numbers to timeline.json only.
EXTRAS_REQUIRE = {"plot": ["matplotlib"]}
HERE = os.path.dirname(os.path.abspath(__file__))


def _startup_hook():
    """(file name, contents) of the startup .pth, from sntf_startup.py."""
    spec = importlib.util.spec_from_file_location(
        "sntf_startup", os.path.join(HERE, "sntf_startup.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.PTH_NAME, module.PTH_LINE


def _write_startup_hook(folder):
    name, line = _startup_hook()
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, name)
    with open(path, "w", encoding="utf-8") as f:
        f.write(line)
    return path


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
    """A shared library linked from its sources' objects."""

    def __init__(self, name, sources, kind):
        super().__init__(name, sources=sources)
        self.kind = kind  # "ops", "plugin" or "model" (no TensorFlow)


class BuildNative(build_ext):
    """Compiles the native libraries with g++ and TensorFlow's own flags,
    one source per core at a time (each takes about 10 s against
    TensorFlow's headers), then links each library."""

    def build_extension(self, ext):
        compile_flags, link_flags, tf_lib_dir = _tensorflow_flags()
        output = self.get_ext_fullpath(ext.name)
        os.makedirs(os.path.dirname(output), exist_ok=True)
        # -w: TensorFlow's headers emit thousands of deprecation warnings.
        command = ["g++", "-fPIC", "-O2", "-w", "-std=c++17"]
        if ext.kind != "model":
            command += compile_flags
        command += ["-I" + os.path.join(HERE, "tf_ops")]
        if ext.kind in ("plugin", "model"):
            import pybind11

            command += ["-I" + pybind11.get_include(),
                        "-I" + sysconfig.get_paths()["include"],
                        "-fvisibility=hidden"]
        objects_dir = os.path.join(self.build_temp, ext.name)
        os.makedirs(objects_dir, exist_ok=True)
        objects = [os.path.join(objects_dir, os.path.basename(s) + ".o")
                   for s in ext.sources]
        jobs = [command + ["-c", os.path.join(HERE, source), "-o", obj]
                for source, obj in zip(ext.sources, objects)]
        with concurrent.futures.ThreadPoolExecutor(os.cpu_count() or 1) as pool:
            list(pool.map(_run, jobs))   # re-raises the first failure
        link = ["g++", "-shared", "-fPIC"] + objects + ["-o", output]
        if ext.kind != "model":
            link += link_flags
        if ext.kind == "plugin":
            # The TF_* grappler symbols live in libtensorflow_cc.so.2.
            link += ["-L" + tf_lib_dir, "-l:libtensorflow_cc.so.2"]
        _run(link)


def _run(command: list) -> None:
    print(" ".join(command), flush=True)
    subprocess.check_call(command)


class BuildPyWithStartupHook(build_py):
    """A wheel carries the .pth at its root, which lands in site-packages."""

    def run(self):
        super().run()
        _write_startup_hook(self.build_lib)

    def get_outputs(self, include_bytecode=1):
        name, _ = _startup_hook()
        return super().get_outputs(include_bytecode) + [os.path.join(self.build_lib, name)]


class DevelopWithStartupHook(develop):
    """`pip install -e .` through the legacy develop command (no
    pyproject.toml, as here): the .pth goes next to sntf's egg-link."""

    def run(self):
        super().run()
        if not self.uninstall:
            _write_startup_hook(self.install_dir)


COMMANDS = {"build_ext": BuildNative, "build_py": BuildPyWithStartupHook,
            "develop": DevelopWithStartupHook}
try:  # PEP 660 editable installs (setuptools >= 64, a newer pip)
    from setuptools.command.editable_wheel import editable_wheel

    class EditableWheelWithStartupHook(editable_wheel):
        """Editable wheels carry the .pth at their root too."""

        def _run_build_commands(self, dist_name, unpacked_wheel, build_lib, tmp_dir):
            result = super()._run_build_commands(dist_name, unpacked_wheel, build_lib,
                                                 tmp_dir)
            _write_startup_hook(str(unpacked_wheel))
            return result

    COMMANDS["editable_wheel"] = EditableWheelWithStartupHook
except ImportError:
    pass


setup(
    name="sntf",
    version="0.1.0",
    description="Superneurons-style memory management for TensorFlow 2",
    packages=find_packages(include=["sntf", "sntf.*"]),
    py_modules=["sntf_startup"],
    python_requires=">=3.10",
    install_requires=[TF_REQUIREMENT, "numpy", "absl-py"],
    extras_require=EXTRAS_REQUIRE,
    entry_points=ENTRY_POINTS,
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
        NativeExtension("sntf._bfc_model", ["tf_ops/bfc_model.cc"], kind="model"),
        NativeExtension("sntf._graph_walks", ["tf_ops/graph_walks.cc"], kind="model"),
    ],
    cmdclass=COMMANDS,
    zip_safe=False,
)
