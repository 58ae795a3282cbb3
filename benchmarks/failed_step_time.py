"""How long a step that runs out of memory under a hard limit takes to fail.

    .venv/bin/python benchmarks/failed_step_time.py [--sides 1,4] [--limit_mib 120]

TensorFlow alone, no sntf. Each run is a fresh process under
TF_CPU_ALLOCATOR_USE_BFC=true TF_CPU_BFC_MEM_LIMIT_IN_MB=limit, one inter-op
thread, and one tf.function: a chain h = h * 1.5 of 24 MiB tensors, with
`sides` ops beside it that each concatenate four copies of h (96 MiB, which
cannot fit). The chain goes on after the first side op fails, so every side
op runs and fails in turn, each after the BFC allocator's 10 s retry
(docs/tensorflow.md, "A failed op does not stop the step at once"). Prints
one line per run:

    sides=4 limit=120MiB: ResourceExhaustedError after 40.1 s
"""

import os
import subprocess
import sys

from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_list("sides", ["1", "4"], "side ops that cannot fit, one run each")
flags.DEFINE_integer("limit_mib", 120, "the CPU BFC allocator's hard limit", lower_bound=1)

STEP = """
import sys, time
import tensorflow as tf
tf.config.threading.set_inter_op_parallelism_threads(1)
SIDES = int(sys.argv[1])

@tf.function
def step(a):
    h = a * 2.0
    sides = []
    for _ in range(SIDES):
        sides.append(tf.reduce_max(tf.concat([h, h, h, h], 0)))
        h = h * 1.5
    return tf.add_n(sides) + tf.reduce_sum(h)

a = tf.ones([6 << 20])                     # 24 MiB of float32
start = time.perf_counter()
try:
    step(a)
    print(f"trained after {time.perf_counter() - start:.1f} s")
except tf.errors.ResourceExhaustedError:
    print(f"ResourceExhaustedError after {time.perf_counter() - start:.1f} s")
"""


def main(argv) -> int:
    del argv
    env = dict(os.environ, TF_CPU_ALLOCATOR_USE_BFC="true",
               TF_CPU_BFC_MEM_LIMIT_IN_MB=str(FLAGS.limit_mib), TF_CPP_MIN_LOG_LEVEL="3")
    for sides in FLAGS.sides:
        out = subprocess.run([sys.executable, "-c", STEP, sides], env=env,
                             capture_output=True, text=True, timeout=600)
        last = (out.stdout.strip().splitlines() or [out.stderr.strip()[-200:]])[-1]
        print(f"sides={sides} limit={FLAGS.limit_mib}MiB: {last}", flush=True)
    return 0


if __name__ == "__main__":
    app.run(main)
