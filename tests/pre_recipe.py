"""The built-in defaults before they moved to the DPNAS private recipe (tests/test_config.py checks the new ones,
and that these equal configs/darts_default.yaml): the DARTS space with every op, DARTS' search batch and learning
rates, σ as configured (no target ε) and the augmentation's old epochs, batch and lr. The tests written for those
defaults pin them: ``load_config(None, [*PRE_RECIPE, ...])``, or ``*PRE_RECIPE_ARGS`` first on a command line (a
later ``--set`` wins). A module of its own, so that tests/ and tests/mpi (which has its own conftest) both import it.
"""

PRE_RECIPE = ["space.kind=darts", "space.ops=[]", "search.batch_size=16", "search.w_lr=0.1", "search.a_lr=0.003",
              "privacy.target_epsilon=null", "augment.epochs=4", "augment.batch_size=64", "augment.lr=0.3"]
PRE_RECIPE_ARGS = [arg for item in PRE_RECIPE for arg in ("--set", item)]

#: The tiny data and network of most small runs: 400 train and 40 test images of 8x8, 3 cells of 4 channels and 2
#: nodes, search batches of 8 (a few seconds a run on 2 cores).
TINY_CORE = ["data.train_size=400", "data.test_size=40", "data.image_size=8", "space.channels=4", "space.layers=3",
             "space.nodes=2", "search.batch_size=8"]

#: DARTS' space cut to 4 of its 8 ops for tiny runs (a convolution of each kind, a pool and the skip: every op the
#: tests' given cells use): the per-example gradients of all 8 took a third more of a tiny run's CPU.
TINY_DARTS_OPS = "space.ops=[sep_conv_3x3,dil_conv_3x3,max_pool_3x3,skip_connect]"


def tiny(*changes: str) -> list[str]:
    """TINY_CORE with `changes` (KEY=VALUE): a key already there takes the new value in its place, a new key is
    appended."""
    settings = dict(item.split("=", 1) for item in TINY_CORE)
    settings.update(item.split("=", 1) for item in changes)
    return [f"{key}={value}" for key, value in settings.items()]


def as_args(settings: list[str]) -> list[str]:
    """KEY=VALUE settings as a command line's --set pairs."""
    return [arg for item in settings for arg in ("--set", item)]
