"""Self-distillation (distill.py) and head training (train.py); data formats and assistant-token labels in data.py.

Imported only by `medusa distill` / `medusa train`, so that generation never pays for `peft` or `Trainer`.
"""
