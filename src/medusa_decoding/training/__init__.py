"""Self-distillation (distill.py) and head training (train.py, on losses.py's objective, trainer.py's Trainer and
start.py's backbone and heads); data formats and assistant-token labels in data.py.

Imported only by `medusa distill` / `medusa train`, so that generation never pays for `peft` or `Trainer`.
"""
