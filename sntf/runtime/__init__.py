"""The runtime layer: the only part of sntf, besides its compiled ops, that
touches TensorFlow's runtime.

    plugin        the Python side of the Grappler plugin shim
    native        loading the compiled op library and the host pool's C API
    environment   what the pass reads of the process
    keras_hooks   Keras' jit_compile guard and the batch fit() feeds
"""
