"""On the corpus' real training graphs, a rewritten graph takes every
order-dependent sum's decision the original graph takes: each AddN of three
or more inputs forwards the same input under the executor order the
analysis emulates for each graph (sntf.graph.accumulations)."""

import os

import pytest

from conftest import REPO
from sntf import analysis, graph
from sntf.graph import accumulations
from sntf.graph.fusions import merged_kernels
from sntf.testing import corpus

FOLDER = os.path.join(REPO, "tests", "corpus", "graphs")
CONFIGS = (corpus.config("swap+recompute", keep_graphs=True),
           corpus.config("recompute", keep_graphs=True, recompute_mode="memory"))


def _decisions(graph_def, onednn: bool, names) -> dict:
    g = graph.build_index(graph_def)
    order = analysis.schedule(g, merged=merged_kernels(g) if onednn else None)
    return {name: accumulations.forwarded_slot(g, g.index[name], order) for name in names}


ENTRIES = sorted(n[:-len(".json.gz")] for n in os.listdir(FOLDER)
                 if n.startswith(("family-", "zoo-")))


@pytest.mark.slow
def test_rewritten_sums_forward_what_the_original_forwards():
    checked, wrong = 0, []
    for name in ENTRIES:
        entry = corpus.load(os.path.join(FOLDER, name + ".json.gz"))
        for cfg in CONFIGS:
            report = corpus.run(entry, cfg).report
            if report["action"] != "rewritten":
                continue
            original = report["original_graph"]
            g = graph.build_index(original)
            sums = [g.names[i] for i in accumulations.reordering_sums(g)]
            want = _decisions(original, entry.onednn, sums)
            got = _decisions(report["rewritten_graph"], entry.onednn, sums)
            wrong += [(name, n, want[n], got[n]) for n in sums if want[n] != got[n]]
            checked += len(sums)
    assert not wrong, wrong[:5]
    # The residual networks of the corpus (its ResNet, DenseNet, SE-ResNet,
    # pre-activation ResNets) have such sums in every block.
    assert checked >= 100
