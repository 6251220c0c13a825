"""Per-layer input covariance collection with forward pre-hooks.

For every editable layer we accumulate the uncentered second moment ``Σ = Σ_t x_t x_tᵀ`` of its
input over the counted tokens, and the token count. A layer with a bias uses the augmented input
``[x; 1]`` so the bias is edited with the weight (affine-correct engram).

Layers that read the very same tensor in a forward pass (q/k/v off one norm, gate/up off another)
have identical statistics: they form one *input group*, computed and stored once.

Only the block upper triangle of each batch's ``XᵀX`` is computed (``Σ`` is symmetric; about 56%
of the multiply-adds); the lower one is mirrored once, at the end.

Precision, on purpose: each batch's product ``XᵀX`` is a float32 GEMM on the model's device (fast,
TF32 disabled so CUDA keeps full float32 mantissas), and the running sum is float64 on that same
device, so a million-token sum loses nothing to accumulation order. A bf16 model's activations are
upcast to float32 before the product.

Layers that read one row per sequence (BERT's ``pooler.dense`` reads the ``[CLS]`` row,
``hidden[:, 0]``): their input has one row per record, not one per token, and their statistics are
summed over exactly those rows, one per record that counts (a record with at least one counted
token), so their count is the number of records. A batch of one-token sequences is both at once,
and then the two readings agree (the row is the record's only token, counted when the record is).
A layer whose input has neither shape gets no statistics and is listed in
:attr:`LayerStatistics.lacking`, never given wrong ones.

Fused experts (:mod:`service.engine.experts`): one pre-hook on the experts module reads the call's
hidden states and top-k routing; each expert's gate/up group sums the counted tokens routed to it,
its down group ``act(gate)·up`` of those tokens, recomputed as the forward does. An expert no counted
token reached has a group with count 0 and a zero sum, not a missing one.

Models spread over several devices (accelerate's ``device_map``): each group's accumulator lives on
the device its layer's input arrives on, so no activation crosses devices for the statistics.

Convolutions (:mod:`service.engine.conv`): a conv layer's rows are its unfolded patches, one per
output position, so its count is the number of output positions. Two convs reading the same tensor
share a group only when they unfold it alike (same kernel, stride, padding, dilation): ResNet's
3×3 and 1×1 shortcut convs read one tensor and get two groups. In a text batch a ``Conv1d`` whose
output has one position per token counts the positions of counted tokens; any other conv input in a
text batch is ``lacking``.

Images (:class:`PixelBatch`): every record counts, whole, so every row of every hooked input (each
patch token of a ViT, each output position of a conv) enters the sums.

Low-rank concepts: while an input group has seen no more tokens than it is wide (``T ≤ D``), its
rows ``X`` are kept as they are (float32, exactly the activations) instead of being summed: ``XᵀX``
then has rank ``T`` and the ``[T, D]`` rows are smaller to store than any ``D × D`` matrix. The
first batch that takes the group past ``D`` tokens turns the rows into the running sum.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from service.engine.conv import patch_chunks
from service.engine.errors import CollectionCancelled as CollectionCancelled  # noqa: PLC0414  (re-exported)
from service.engine.expert_names import DOWN
from service.engine.experts import ExpertRequest, down_input, expert_requests, experts_call, routed_to
from service.engine.layers import LayerSpec
from service.engine.linalg import add_upper_gram_, gram, mirror_upper_
from service.engine.records import Batch

PRODUCT_DTYPE = torch.float32


@dataclass
class PixelBatch:
    """Images for an image model: ``pixel_values`` ``[B, C, H, W]`` as its image processor makes them.

    Every image counts, whole (there are no prompt or pad positions in an image).
    """

    pixel_values: torch.Tensor

    @property
    def counted(self) -> torch.Tensor:
        """One counted entry per image (``[B, 1]``), as :class:`Batch` has one per token."""
        return torch.ones((self.pixel_values.shape[0], 1), dtype=torch.bool)

    @property
    def num_counted(self) -> int:
        """The images in the batch."""
        return int(self.pixel_values.shape[0])


AnyBatch = Batch | PixelBatch


@dataclass
class LayerStatistics:
    """Sufficient statistics of one concept on one model.

    Attributes:
        sums: input group key -> ``Σ x xᵀ`` (float64, ``[D, D]``; D includes the bias column).
        counts: input group key -> tokens that entered the sum.
        layer_group: layer name -> its input group key.
        factors: input group key -> its rows ``X`` (float32, ``[T, D]``, ``sums[g] = XᵀX``), for
            the groups that saw no more tokens than they are wide; what storage keeps of them.
        lacking: hooked layers without statistics: their input was neither one row per token nor
            one per record, or the forward pass never called them (sorted names; empty for every
            dense model).
        unreached: the lacking layers the forward pass never called (a vision tower, when the
            records are text): their statistics are zero, so every edit of them is zero too.
    """

    sums: dict[str, torch.Tensor] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)
    layer_group: dict[str, str] = field(default_factory=dict)
    factors: dict[str, torch.Tensor] = field(default_factory=dict)
    lacking: list[str] = field(default_factory=list)
    unreached: list[str] = field(default_factory=list)
    devices: dict[str, str] = field(default_factory=dict)  # group -> where it was accumulated ("cuda:1")

    @property
    def tokens(self) -> int:
        """Counted tokens (the same for every dense layer)."""
        return max(self.counts.values(), default=0)

    def sum_for(self, layer: str) -> torch.Tensor:
        return self.sums[self.layer_group[layer]]


class _Collector:
    """Holds the accumulators and the per-forward input-sharing table the hooks use."""

    def __init__(self, layers: Sequence[LayerSpec]) -> None:
        self.specs = {spec.name: spec for spec in layers}
        self.stats = LayerStatistics()
        # The batch's counted mask: per token ([B·S]) and per record ([B]), moved to each device once.
        self._token_mask: torch.Tensor | None = None
        self._record_mask: torch.Tensor | None = None
        self._masks: dict[tuple[str, torch.device], torch.Tensor] = {}
        self._kinds: dict[str, str] = {}  # layer -> "token" or "record", as its first batch showed
        self._every_row = False  # an image batch: every row of every input counts
        # (id(input tensor), bias[, conv kernel]) -> (tensor kept alive so the id stays unique, group key)
        self._seen: dict[tuple[Any, ...], tuple[torch.Tensor, str]] = {}
        self.unaligned: set[str] = set()
        # Modules holding hooked layers that the forward ran ("": the model itself, which always runs).
        self.called_parents: set[str] = {""}
        # group -> its rows so far, while the group has seen no more tokens than it is wide
        self._rows: dict[str, list[torch.Tensor]] = {}

    def start_batch(self, counted: torch.Tensor, every_row: bool = False) -> None:
        self._every_row = every_row
        self._token_mask = counted.reshape(-1)
        self._record_mask = counted.reshape(counted.shape[0], -1).any(dim=1)
        self._masks.clear()
        self._seen.clear()

    def _mask(self, layer: str, rows: int, device: torch.device) -> torch.Tensor | None:
        """The counted rows of an input with ``rows`` rows: per token, per record, or ``None`` (neither,
        or not the reading this layer had in earlier batches)."""
        if self._token_mask is None or self._record_mask is None:
            return None
        if rows == self._token_mask.shape[0]:
            kind, mask = "token", self._token_mask
        elif rows == self._record_mask.shape[0]:
            kind, mask = "record", self._record_mask
        else:
            return None
        if self._token_mask.shape[0] != self._record_mask.shape[0]:  # one-token sequences fit both
            if self._kinds.setdefault(layer, kind) != kind:
                return None
        key = (kind, device)
        if key not in self._masks:
            self._masks[key] = mask.to(device)
        return self._masks[key]

    def parent_hook(self, name: str) -> Callable[[nn.Module, tuple[Any, ...]], None]:
        """Records that the module ``name``, which holds hooked layers, ran (see ``unreached``)."""

        def pre_hook(_module: nn.Module, _inputs: tuple[Any, ...]) -> None:
            self.called_parents.add(name)

        return pre_hook

    def hook(self, name: str) -> Callable[[nn.Module, tuple[Any, ...]], None]:
        spec = self.specs[name]

        def pre_hook(_module: nn.Module, inputs: tuple[Any, ...]) -> None:
            if spec.kernel is not None:
                self._accumulate_conv(spec, inputs[0])
            else:
                self._accumulate(spec, inputs[0])

        return pre_hook

    def _accumulate(self, spec: LayerSpec, raw: torch.Tensor) -> None:
        key = (id(raw), spec.bias)
        shared = self._seen.get(key)
        if shared is not None:
            self._assign(spec.name, shared[1])
            return
        rows = raw.reshape(-1, raw.shape[-1])
        if self._every_row:
            x = rows.to(PRODUCT_DTYPE)  # on the layer's own device: its accumulator lives there
        else:
            mask = self._mask(spec.name, rows.shape[0], rows.device)
            if mask is None or spec.name in self.unaligned:
                # Neither one row per token nor one per record (experts reading only their routed
                # tokens): no statistics rather than wrong ones; listed in ``lacking``.
                self.unaligned.add(spec.name)
                return
            x = rows[mask].to(PRODUCT_DTYPE)
        self._add(self._group_for(spec, key, raw), _with_bias_column(x, spec.bias))

    def _group_for(self, spec: LayerSpec, key: tuple[Any, ...], raw: torch.Tensor) -> str:
        """The input group ``spec`` adds to this batch (its own name, the first time), remembered for
        the layers that read ``raw`` after it."""
        group = self.stats.layer_group.get(spec.name, spec.name)
        self._seen[key] = (raw, group)
        self._assign(spec.name, group)
        return group

    def _accumulate_conv(self, spec: LayerSpec, raw: torch.Tensor) -> None:
        """A convolution's unfolded patches of the counted output positions, a few records at a time."""
        kernel = spec.kernel
        assert kernel is not None
        key = (id(raw), spec.bias, kernel)  # shared only by convs that unfold the input alike
        shared = self._seen.get(key)
        if shared is not None:
            self._assign(spec.name, shared[1])
            return
        positions = None if self._every_row else self._conv_positions(spec, raw)
        if spec.name in self.unaligned or (positions is None and not self._every_row):
            self.unaligned.add(spec.name)  # not an input whose positions match the counted tokens
            return
        group = self._group_for(spec, key, raw)
        for x in patch_chunks(raw, kernel, PRODUCT_DTYPE, positions):
            self._add(group, _with_bias_column(x, spec.bias))

    def _conv_positions(self, spec: LayerSpec, raw: torch.Tensor) -> torch.Tensor | None:
        """In a text batch, a ``Conv1d`` with one output position per token: the counted tokens'
        positions (``[B, T]``); ``None`` for any other conv input."""
        kernel = spec.kernel
        token_mask, record_mask = self._token_mask, self._record_mask
        if kernel is None or kernel.spatial_dims != 1 or token_mask is None or record_mask is None:
            return None
        records = record_mask.shape[0]
        tokens = token_mask.shape[0] // max(records, 1)
        if raw.ndim != 3 or raw.shape[0] != records or kernel.output_length(raw.shape[2], 0) != tokens:
            return None
        return token_mask.reshape(records, tokens)

    def _add(self, group: str, x: torch.Tensor) -> None:
        """Add the counted rows ``x`` (float32) to ``group`` (created by its first call, even empty)."""
        if group not in self.stats.counts:
            self.stats.counts[group] = 0
            self._rows[group] = []
            self.stats.devices[group] = str(x.device)
        self.stats.counts[group] += int(x.shape[0])
        rows = self._rows.get(group)
        if rows is None:
            add_upper_gram_(self.stats.sums[group], x)  # the lower triangle is mirrored at the end
        elif self.stats.counts[group] <= x.shape[1]:
            rows.append(x)  # a fresh tensor (masked indexing copies), safe to keep
        else:  # wider than low-rank now: from here on only the sum is kept
            self.stats.sums[group] = gram(torch.cat([*rows, x]) if rows else x)
            del self._rows[group]

    def experts_hook(self, request: ExpertRequest) -> Callable[[nn.Module, tuple[Any, ...], dict[str, Any]], None]:
        def pre_hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            hidden, top_k_index = experts_call(args, kwargs)
            self._accumulate_experts(request, module, hidden, top_k_index)

        return pre_hook

    def _accumulate_experts(
        self, request: ExpertRequest, module: nn.Module, hidden: torch.Tensor, top_k_index: torch.Tensor
    ) -> None:
        """Each requested expert's groups from the counted tokens routed to it (not weighted by the
        routing weight: the expert's maps read the token itself; see :mod:`service.engine.experts`)."""
        rows = hidden.reshape(-1, hidden.shape[-1])
        names = [request.experts.layer_name(e, p) for e, projections in request.wanted.items() for p in projections]
        token_mask = self._token_mask
        if token_mask is None or rows.shape[0] != token_mask.shape[0] or self.unaligned.intersection(names):
            self.unaligned.update(names)  # not one row per token: no statistics rather than wrong ones
            return
        key = ("token", rows.device)
        if key not in self._masks:
            self._masks[key] = token_mask.to(rows.device)
        counted = self._masks[key]
        tokens, routing = rows[counted], top_k_index.reshape(rows.shape[0], -1)[counted.to(top_k_index.device)]
        for expert, projections in request.wanted.items():
            x = tokens[routed_to(routing, expert).to(tokens.device)]
            group = request.input_group(expert)
            if group is not None:
                for projection in (p for p in projections if p != DOWN):
                    self._assign(request.experts.layer_name(expert, projection), group)
                self._add(group, x.to(PRODUCT_DTYPE))
            if DOWN in projections:
                down = request.experts.layer_name(expert, DOWN)
                self._assign(down, down)
                self._add(down, down_input(module, x, expert).to(PRODUCT_DTYPE))

    def _assign(self, layer: str, group: str) -> None:
        previous = self.stats.layer_group.setdefault(layer, group)
        if previous != group:
            raise RuntimeError(f"layer {layer} changed its input group between batches ({previous} -> {group})")

    def finish(self) -> LayerStatistics:
        for name in self.unaligned:
            self.stats.layer_group.pop(name, None)
        used = set(self.stats.layer_group.values())
        sums = {g: mirror_upper_(s) for g, s in self.stats.sums.items() if g in used}
        for group, rows in self._rows.items():
            if group in used:
                factor = torch.cat(rows)
                self.stats.factors[group] = factor.cpu()
                sums[group] = gram(factor)
        self.stats.sums = {g: s.cpu() for g, s in sums.items()}
        self.stats.counts = {g: c for g, c in self.stats.counts.items() if g in used}
        self.stats.devices = {g: d for g, d in self.stats.devices.items() if g in used}
        # Hooked but without statistics: unaligned, or never called by the forward pass.
        self.stats.lacking = sorted(set(self.specs) - set(self.stats.layer_group))
        # Unreached only when the module holding the layer never ran either (a vision tower under
        # text): a layer whose parent ran but whose own forward did not has its weight used some
        # other way (Mamba's dt_proj.weight @ x), so its input exists, unseen: lacking, not zero.
        self.stats.unreached = sorted(
            name for name in set(self.stats.lacking) - self.unaligned if _parent(name) not in self.called_parents
        )
        return self.stats


def _with_bias_column(x: torch.Tensor, bias: bool) -> torch.Tensor:
    """``[x; 1]`` for a layer with a bias (its statistics then edit the bias with the weight)."""
    return torch.cat([x, x.new_ones(x.shape[0], 1)], dim=1) if bias else x


def _model_inputs(batch: AnyBatch, device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The forward's keyword arguments: token ids and mask, or pixels in the model's dtype."""
    if isinstance(batch, PixelBatch):
        return {"pixel_values": batch.pixel_values.to(device, dtype)}
    return {"input_ids": batch.input_ids.to(device), "attention_mask": batch.attention_mask.to(device)}


def model_dtype(model: nn.Module) -> torch.dtype:
    """The dtype of the model's first floating-point parameter (float32 for a model without one)."""
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)


def _parent(layer: str) -> str:
    """The module holding ``layer`` (``""``: the model itself, which always runs)."""
    return layer.rpartition(".")[0]


@contextmanager
def _full_precision_matmul() -> Iterator[None]:
    """Disable TF32 for the covariance GEMMs (it would keep only 10 mantissa bits)."""
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous


def model_device(model: nn.Module) -> torch.device:
    try:
        return next(model.parameters()).device
    except StopIteration:
        return torch.device("cpu")


def collect_statistics(
    model: nn.Module,
    batches: Iterable[AnyBatch],
    layers: Sequence[LayerSpec],
    *,
    on_batch: Callable[[int], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
) -> LayerStatistics:
    """Run ``model`` over ``batches`` and accumulate every layer's input statistics.

    Args:
        model: a transformers model whose modules include ``layers``.
        batches: right-padded batches from :func:`service.engine.records.make_batches`, or images
            (:class:`PixelBatch`).
        layers: the layers to hook.
        on_batch: called after each batch with the number of counted tokens it added.
        should_stop: polled before each batch; returning True raises :class:`CollectionCancelled`.

    Returns:
        The statistics, on the CPU in float64.
    """
    device = model_device(model)  # where the inputs go: the embeddings' device (a device_map's first)
    dtype = model_dtype(model)
    collector = _Collector(layers)
    modules = dict(model.named_modules())
    experts = expert_requests(layers, modules)  # fused experts: one hook per experts module
    handles = [
        modules[spec.name].register_forward_pre_hook(collector.hook(spec.name)) for spec in layers if spec.name in modules
    ]
    handles += [
        modules[name].register_forward_pre_hook(collector.experts_hook(request), with_kwargs=True)
        for name, request in experts.items()
    ]
    parents = {_parent(spec.name) for spec in layers if spec.name in modules}
    handles += [modules[name].register_forward_pre_hook(collector.parent_hook(name)) for name in parents if name]
    model.eval()
    try:
        with torch.inference_mode(), _full_precision_matmul():
            for batch in batches:
                if should_stop is not None and should_stop():
                    raise CollectionCancelled("collection cancelled")
                collector.start_batch(batch.counted, every_row=isinstance(batch, PixelBatch))
                model(**_model_inputs(batch, device, dtype))
                if on_batch is not None:
                    on_batch(batch.num_counted)
            return collector.finish()  # the sums are inference tensors: completed in that mode
    finally:
        for handle in handles:
            handle.remove()
