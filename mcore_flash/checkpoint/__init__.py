"""Checkpoints: the directory protocol (:mod:`.directory`), which flags define a model
(:mod:`.model_args`), the manifest and safe unpickling, the formats behind one interface
(:mod:`.formats`: ``torch_dist``, ``fsdp_dtensor``), the compatibility checks, and the
:class:`~.checkpointer.Checkpointer` that saves, loads and runs background saves. Nothing is
imported here: importing a leaf (``directory``, ``model_args``) loads no format."""
