"""Jacobians by vertex elimination (cross-country elimination) for JAX and Equinox."""

from ._equinox import (
    eqx_jacve as eqx_jacve,
    filter_jacve as filter_jacve,
    filter_value_and_jacve as filter_value_and_jacve,
)
from ._indexed import CooTensor as CooTensor
from ._jacve import (
    Edge as Edge,
    Graph as Graph,
    Vertex as Vertex,
    jacve as jacve,
    make_graph as make_graph,
    value_and_jacve as value_and_jacve,
)
from ._orders import Order as Order
from ._search import (
    EliminationCost as EliminationCost,
    OrderSearch as OrderSearch,
    elimination_cost as elimination_cost,
    load_order as load_order,
    search_order as search_order,
)
from ._sparse import SparseTensor as SparseTensor


__version__ = "0.1.0"
