"""The built-in defaults before issue 46 moved them to the DPNAS recipe (tests/test_config.py checks the new ones,
and that these equal configs/darts_default.yaml): the DARTS space with every op, DARTS' search batch and learning
rates, σ as configured (no target ε) and the augmentation's old epochs, batch and lr. The tests written for those
defaults pin them: ``load_config(None, [*PRE_RECIPE, ...])``, or ``*PRE_RECIPE_ARGS`` first on a command line (a
later ``--set`` wins). A module of its own, so that tests/ and tests/mpi (which has its own conftest) both import it.
"""

PRE_RECIPE = ["space.kind=darts", "space.ops=[]", "search.batch_size=16", "search.w_lr=0.1", "search.a_lr=0.003",
              "privacy.target_epsilon=null", "augment.epochs=4", "augment.batch_size=64", "augment.lr=0.3"]
PRE_RECIPE_ARGS = [arg for item in PRE_RECIPE for arg in ("--set", item)]
