"""`medusa` whose training dies (os._exit, as a SIGKILL would end it) when the step $KILL_AT starts, in every process
at the same point: test_train_processes.py's killed run, without a race against a fast run."""

import os
import sys

from medusa_decoding.cli import main
from medusa_decoding.training.trainer import MedusaTrainer

KILL_AT = int(os.environ["KILL_AT"])
compute_loss = MedusaTrainer.compute_loss


def dying_compute_loss(self, *args, **kwargs):
    if self.state.global_step == KILL_AT and self.model.training:
        os._exit(9)
    return compute_loss(self, *args, **kwargs)


MedusaTrainer.compute_loss = dying_compute_loss
main(sys.argv[1:])
