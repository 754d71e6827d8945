"""Pipeline stages: which decoder layers each stage of an engine holds.

With ``pipeline_parallel_size`` P, an engine's model is cut into P consecutive runs of
layers. Stage 0 also holds the token embedding, the last stage the final norm and the LM
head (and the embedding too when the head is tied to it). A stage's workers build only
what they hold: the other layers are :class:`MissingLayer` placeholders, so parameter
names keep the checkpoint's layer numbers and the loader skips the tensors of other
stages (:meth:`Stage.holds`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from aserve.errors import ConfigError

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def parse_partition(text: str | None) -> tuple[int, ...] | None:
    """``--pp-layer-partition "5,7"`` -> (5, 7); None or empty -> None. ConfigError for
    anything but comma-separated positive integers."""
    if not text:
        return None
    try:
        parts = tuple(int(p) for p in text.split(","))
    except ValueError:
        raise ConfigError(f"pp_layer_partition must be comma-separated layer counts, got {text!r}",
                          param="pp_layer_partition") from None
    if any(p < 1 for p in parts):
        raise ConfigError(f"every stage of pp_layer_partition needs at least one layer, got {text!r}",
                          param="pp_layer_partition")
    return parts


def stage_layers(num_layers: int, pp: int, partition: tuple[int, ...] | None = None) -> list[tuple[int, int]]:
    """``[start, end)`` of each stage's layers. Even by default; where the layers do not
    divide, the extra ones go to the stages before the last, from the second-to-last
    backwards (the last stage also computes the LM head; vLLM's rule). ``partition``
    gives each stage's count instead. ConfigError where the counts cannot work."""
    if pp < 1:
        raise ConfigError("pipeline_parallel_size must be >= 1", param="pipeline_parallel_size")
    if pp > num_layers:
        raise ConfigError(f"pipeline_parallel_size={pp} exceeds the model's {num_layers} layers: every stage "
                          "needs at least one", param="pipeline_parallel_size")
    if partition is not None:
        if len(partition) != pp or sum(partition) != num_layers:
            raise ConfigError(f"pp_layer_partition {','.join(map(str, partition))} must give {pp} stages summing to "
                              f"the model's {num_layers} layers", param="pp_layer_partition")
        counts = list(partition)
    else:
        counts = [num_layers // pp] * pp
        for i in range(num_layers % pp):
            counts[-2 - i] += 1
    bounds, start = [], 0
    for count in counts:
        bounds.append((start, start + count))
        start += count
    return bounds


@dataclass(frozen=True)
class Stage:
    """One stage of the pipeline: its index, the stage count, and its layers ``[start, end)``."""

    rank: int
    size: int
    start: int
    end: int

    @classmethod
    def whole(cls, num_layers: int) -> Stage:
        return cls(0, 1, 0, num_layers)

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        return self.rank == self.size - 1

    @property
    def num_layers(self) -> int:
        return self.end - self.start

    def holds_layer(self, index: int) -> bool:
        return self.start <= index < self.end

    def holds(self, name: str, *, tied_embeddings: bool) -> bool:
        """Whether a parameter (by its name in the model) belongs to this stage."""
        layer = _LAYER.match(name)
        if layer is not None:
            return self.holds_layer(int(layer.group(1)))
        if name.startswith("model.embed_tokens."):
            return self.is_first or (self.is_last and tied_embeddings)
        if name.startswith(("model.norm.", "lm_head.")):
            return self.is_last
        return True
