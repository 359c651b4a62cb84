"""Random number generator states, saved and put back: the accuracy guard's checks and the
lossless shadow run the model without changing what training draws next."""

from __future__ import annotations

import torch


class RandomStates:
    """The CPU generator's state and, where CUDA is in use, every device's."""

    def __init__(self) -> None:
        self.cpu = torch.get_rng_state()
        self.cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state_all(self.cuda)
