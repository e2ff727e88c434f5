"""What the data-parallel ranks of an OPSD step tell each other: one all-gather of a few counts.

Each rank distils its own rollout. Before any forward, every rank learns every rank's
:class:`RankFigures`, so that all of them (a) raise the same error when any rank's batch is unusable,
(b) weight their loss by ``n_rank * world / n_total`` (DeepSpeed averages gradients over the ranks,
which then yields the mean over all response positions of all ranks) and (c) run the same number
of micro-batches and teacher forwards (ZeRO-2/3 run collectives in each of them).
"""

from __future__ import annotations

from dataclasses import astuple, dataclass

import torch

from rollout.checks import require


@dataclass(frozen=True)
class RankFigures:
    """One rank's counts."""

    num_positions: int
    """Response positions in the rank's loss."""
    num_micro_batches: int
    """Student micro-batches the rank planned."""
    num_teacher_forwards: int
    """Teacher forwards the rank planned."""
    num_rows: int
    """Rows with a loss position."""
    max_token_id: int
    """Largest token id of the rank's batch (-1: the batch has no rows)."""
    min_token_id: int = 0
    """Smallest token id of the rank's batch and teacher prompts."""
    refused: int = 0
    """1: the rank refused its own inputs before the step (it raises its own error; the others name the rank)."""


def gather_figures(local: RankFigures, group=None, device: torch.device = torch.device("cpu")) -> list[RankFigures]:
    """Every data-parallel rank's figures, in rank order (``[local]`` without a process group).

    ``device``: where the collective's tensors live under NCCL (the CPU for any other backend).
    """
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) <= 1:
        return [local]
    device = device if dist.get_backend(group) == "nccl" else torch.device("cpu")
    mine = torch.tensor(astuple(local), dtype=torch.int64, device=device)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(every, mine, group=group)
    return [RankFigures(*row) for row in torch.stack(every).tolist()]


def check_figures(figures: list[RankFigures], teacher_vocab_size: int) -> None:
    """The same ValueError on every rank when any rank's batch cannot be distilled."""
    for rank, figure in enumerate(figures):
        where = "" if len(figures) == 1 else f" on data-parallel rank {rank}"
        require(not figure.refused, "batch", f"refused{where}: that rank's error names the field")
        require(figure.max_token_id >= 0 or figure.num_positions > 0, "batch", f"has no rows{where} (nothing to distil "
                "on)")
        require(figure.num_positions > 0, "mask", f"the batch{where} has no response position to distil on "
                 "(every response token is masked out)")
        require(figure.min_token_id >= 0, "input_ids", f"token ids must be >= 0; got {figure.min_token_id} in the "
                 f"batch{where} (or its teacher prompts)")
        require(figure.max_token_id < teacher_vocab_size, "teacher vocab_size",
                 f"{teacher_vocab_size} does not contain token id {figure.max_token_id} of the batch{where}; "
                 "the teacher cannot score the student's tokens")


def rank_weight(figures: list[RankFigures], local: RankFigures) -> float:
    """``n_rank * world / n_total`` for this rank (``local``): 1.0 on a single rank."""
    if len(figures) == 1:
        return 1.0
    return local.num_positions * len(figures) / sum(figure.num_positions for figure in figures)


#: The figures of a rank whose batch has no rows: :func:`check_figures` refuses them on every rank.
EMPTY_FIGURES = RankFigures(0, 0, 0, 0, -1)
#: The figures of a rank that refused its own inputs (a ValueError naming the field) before the step's collectives: it
#: takes part in them with these, then raises its error; :func:`check_figures` makes every other rank raise too.
REFUSED_FIGURES = RankFigures(0, 0, 0, 0, -1, 0, 1)
