"""A torch.compile backend that keeps the graphs it is given, for tests that count op nodes in them."""
from functorch.compile import make_boxed_func
from torch._functorch.aot_autograd import aot_module_simplified


class GraphCapture:
    """A torch.compile backend that keeps dynamo's graph and AOTAutograd's forward and backward graphs
    (runs them uncompiled)."""

    def __init__(self):
        self.dynamo, self.forward, self.backward = [], [], []

    def __call__(self, gm, example_inputs):
        self.dynamo.append(gm)

        def keep(graphs):
            def compiler(graph, _):
                graphs.append(graph)
                return make_boxed_func(graph)
            return compiler

        return aot_module_simplified(gm, example_inputs, fw_compiler=keep(self.forward), bw_compiler=keep(self.backward))


def count_nodes(graphs, op) -> int:
    """How many nodes of ``graphs`` call ``op``."""
    return sum(node.target == op for gm in graphs for node in gm.graph.nodes)
