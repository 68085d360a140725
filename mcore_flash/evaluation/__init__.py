"""Evaluation of trained checkpoints: needle retrieval by length x depth and loss by position
(``mcore-flash evaluate``), on the trainer's model under TP/PP/CP."""
