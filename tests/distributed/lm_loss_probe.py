"""Run under torchrun by test_evals.py: every rank evaluates one model's held-out loss with
`pretrain.lm_loss` under the plan's dims and writes {"rows": rows its model saw, "loss": figure}
to `<out>/rank<r>.json`. The model is the same on every rank (same seed, never sharded), so a rank
that evaluates every window and one that evaluates its share differ only in `rows`."""

import json
import sys

import torch
from torch import nn

from contracts.models import MODEL_SHAPES
from training.engine import distributed
from training.engine.distributed import ParallelDims
from training.model import Transformer
from training.recipes.pretrain import lm_loss


class Counting(nn.Module):
    """The model, counting the rows of every batch it is asked for."""

    def __init__(self, model: Transformer) -> None:
        super().__init__()
        self.model = model
        self.rows = 0

    def forward(
        self, x: torch.Tensor, y: torch.Tensor, **options: object
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        self.rows += x.shape[0]
        return self.model(x, y, **options)  # e.g. return_logits=False: the eval needs no logits


def main(out: str, strategy: str, degrees: str, windows: int) -> None:
    device = distributed.init("cpu")
    torch.manual_seed(0)
    model = Counting(Transformer(MODEL_SHAPES["tiny"]))
    tokens = torch.randint(0, 256, (windows * 16 + 1,))
    dims = ParallelDims.from_plan(strategy, json.loads(degrees))
    loss = lm_loss(model, tokens, seq_len=16, batch_size=4, max_batches=100, device=device, parallel=dims)  # type: ignore[arg-type]
    with open(f"{out}/rank{distributed.rank()}.json", "w") as f:
        json.dump({"rows": model.rows, "loss": loss}, f)
    distributed.close()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]))
