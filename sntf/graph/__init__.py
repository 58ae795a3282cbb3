"""Graph model: an index over a GraphDef, training detection, phases and the
regions the pass leaves alone, plus every op table and generated name.

Pure functions over plain data; nothing here runs TensorFlow. The names
below are the stage's public interface.
"""

from sntf.graph.identity import graph_key
from sntf.graph.index import (GraphError, GraphIndex, ancestors, build_index,
                              descendants, name_hint, on_gpu, parse_input)
from sntf.graph.optable import is_gradient_op, is_update_op
from sntf.graph.phases import (BACKWARD, FORWARD, OTHER, classify_phases, waits_for_loss,
                               weight_consumers)
from sntf.graph.regions import control_flow_region, loop_ops, xla_compiled
from sntf.graph.training import (TrainingInfo, detect_training, handle_root,
                                 variable_access)
from sntf.graph.updates import updated_index, with_control_inputs

__all__ = [
    "BACKWARD", "FORWARD", "OTHER", "GraphError", "GraphIndex", "TrainingInfo",
    "ancestors", "build_index", "classify_phases", "control_flow_region",
    "descendants", "detect_training", "graph_key", "handle_root", "is_gradient_op",
    "is_update_op", "loop_ops", "name_hint", "on_gpu", "parse_input", "updated_index",
    "variable_access", "waits_for_loss", "weight_consumers", "with_control_inputs",
    "xla_compiled",
]
