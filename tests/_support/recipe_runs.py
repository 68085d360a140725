"""Several short training runs in one launch (process start-up dominates on 2 cores).

    per_rank = run_distributed(w_recipe_runs, 2, [("name", flags), ...], str(tmp_path), measure)

Each run: ``mcore-flash pretrain``'s config of :data:`TINY` + its flags, :data:`STEPS`
iterations of the trainer's ``PretrainRecipe`` (no checkpoint), then
``measure(recipe, baseline)`` (top-level functions, so spawn can pickle them) gives what the
worker returns for that run, with the ``(loss, grad norm)`` of every step under ``"steps"``;
``baseline`` is what ``before()`` returned just before the run was set up (None without
``before``): e.g. the device's bytes, which earlier runs of the launch leave above zero.
"""

from __future__ import annotations

STEPS = 3
TINY = [
    "--num-layers",
    "2",
    "--hidden-size",
    "64",
    "--ffn-hidden-size",
    "128",
    "--num-attention-heads",
    "4",
    "--num-query-groups",
    "2",
    "--seq-length",
    "64",
    "--max-position-embeddings",
    "64",
    "--micro-batch-size",
    "1",
    "--global-batch-size",
    "4",
    "--lr",
    "1e-3",
    "--lr-warmup-iters",
    "1",
    "--train-iters",
    str(STEPS),
    "--log-interval",
    "1",
    "--make-vocab-size-divisible-by",
    "256",
]


def w_recipe_runs(rank, world_size, runs, save_root, measure, before=None):
    """Worker: ``{name: {"steps": [(loss, grad norm)], **measure(recipe, baseline)}}`` of this rank."""
    from megatron.core import parallel_state

    from mcore_flash.training import distributed, loop
    from mcore_flash.training.arguments import parse_config

    results = {}
    for name, flags in runs:
        baseline = before() if before else None
        config = parse_config([*TINY, *flags, "--save", f"{save_root}/{name}"])
        distributed.init_distributed(config)
        recipe = loop.PretrainRecipe(config)
        try:
            steps = [recipe.train_step() for _ in range(STEPS)]
            results[name] = {"steps": steps, **measure(recipe, baseline)}
        finally:
            recipe.cleanup()
            parallel_state.destroy_model_parallel()
            del recipe  # before the next run's baseline
    return results
