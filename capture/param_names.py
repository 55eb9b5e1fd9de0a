"""The names the store gives the watched models' tensors: parameters and buffers as the modules
hold them now (NOTE: [Live parameter names]), graph placeholders → parameter fqn, the ``params``
rows. A mixin of :class:`graphdeck.capture.agent.Agent`, whose state it reads (``_models``,
``_prefixes``, ``_auto_params``, ``_fqn_by_tensor``, ``_live_fqn``, ``_live_names``, ``writer``)."""

from __future__ import annotations

import json
from typing import Any

import torch
import torch.fx

from graphdeck.capture.compile_record import graph_arg_example
from graphdeck.capture.fxrecord import module_path_from_fqn


class ParamNames:
    """Tensor naming of the capture agent (mixed into :class:`~graphdeck.capture.agent.Agent`)."""

    def named_tensors(self, model: torch.nn.Module, buffers: bool = False):
        """``(name, tensor)`` of ``model``'s parameters (then buffers when ``buffers``), tied
        weights under every name, named as the store names them: as ``named_parameters()`` gives
        them, qualified ``<Class>[k].`` for a watched model whose names collide with an earlier
        one's (NOTE: [Several watched models])."""
        prefix = self._prefixes.get(id(model), "")
        for fqn, t in model.named_parameters(remove_duplicate=False):
            yield prefix + fqn, t
        if buffers:
            for fqn, t in model.named_buffers(remove_duplicate=False):
                yield prefix + fqn, t

    def _write_params(self) -> None:
        named: dict[str, tuple[str, torch.Tensor]] = {}
        for model in self._models:
            n_params = sum(1 for _ in model.named_parameters(remove_duplicate=False))
            for i, (fqn, t) in enumerate(self.named_tensors(model, buffers=True)):
                named[fqn] = ("parameter" if i < n_params else "buffer", t)
        for fqn, t in self._auto_params.items():
            named.setdefault(fqn, ("parameter", t))
        self.writer.write_params([_param_row(fqn, kind, t) for fqn, (kind, t) in named.items()])
        # Whether the list is the models' own (complete) or only what graphs read (analysis.gradients.evidence).
        self.writer.write_compile_events([{"name": "graphdeck_watch", "compile_id": None, "metadata": {},
                                           "payload": json.dumps({"params": len(named), "complete": bool(self._models),
                                                                  "evidence": self._evidence is not None,
                                                                  **self._watch_info})}])

    def _live_name(self, t: Any) -> str | None:
        """The watched models' name for tensor ``t`` as their modules hold it now.

        # NOTE: [Live parameter names]
        # A module's parameters are not always the tensors :meth:`watch` saw: FSDP2 swaps in a
        # sharded DTensor after ``fully_shard`` and the unsharded tensor during its forward, and
        # users re-assign parameters. The names are looked up by identity in the modules'
        # current ``_parameters``/``_buffers``; the table is rebuilt only when a tensor is missing
        # from it (a model of 10^4 parameters costs ~10 ms a rebuild).
        """
        if not self._models:
            return None
        fqn = self._live_fqn.get(id(t))
        if fqn is None:
            live: dict[int, str] = {}
            for model in self._models:
                for name, x in self.named_tensors(model, buffers=True):
                    live.setdefault(id(x), name)
            self._live_fqn = live
            self._live_names = set(live.values())
            fqn = live.get(id(t))
        return fqn

    def _learn_params(self, gm: torch.fx.GraphModule, param_by_node: dict[str, str]) -> None:
        """Without :meth:`watch`, the parameters a graph reads are still listed (from Dynamo's
        graph arguments); parameters no graph reads are then unknown (watch the model to see them)."""
        if self._models:  # watched: every name is known; an unmatched one is bound at run time
            return
        new = False
        for n in gm.graph.nodes:
            fqn = param_by_node.get(n.name)
            if fqn is None or fqn in self._auto_params:
                continue
            example = graph_arg_example(n)
            if isinstance(example, torch.nn.Parameter) and id(example) not in self._fqn_by_tensor:
                self._auto_params[fqn] = example
                new = True
        if new:
            self._write_params()

    def _fqn_of_placeholder(self, node: torch.fx.Node) -> str | None:
        ga = node.meta.get("grapharg")
        if ga is None:
            return None
        example = graph_arg_example(node)
        if example is not None and id(example) in self._fqn_by_tensor:
            return self._fqn_by_tensor[id(example)]
        if isinstance(example, torch.Tensor) and (fqn := self._live_name(example)) is not None:
            return fqn
        source = getattr(ga, "source", None)
        if source is None:
            return None
        attr = getattr(source, "name", None)
        name = attr() if callable(attr) else attr if isinstance(attr, str) else str(source)
        if "_parameters" not in name and "_buffers" not in name:
            return None
        path = module_path_from_fqn(name).replace("/", ".")
        path = path.removeprefix("module.") if path.startswith("module.") else path
        if self._models and self._live_fqn and path not in self._live_names:
            # A path relative to a sub-module's frame (a graph break inside a block, a block
            # compiled on its own): which module it is shows only at run time.
            return None
        return path


def _param_row(fqn: str, kind: str, t: torch.Tensor) -> dict:
    return {"fqn": fqn, "kind": kind, "storage_key": f"{id(t):x}", "shape": list(t.shape),
            "dtype": str(t.dtype).removeprefix("torch."), "numel": t.numel(),
            "size_bytes": t.numel() * t.element_size(),
            "requires_grad": kind == "parameter" and bool(t.requires_grad)}
