"""A modified rank 0, run as ``mpirun -n N python -m lying_server ARGS`` with this directory on PYTHONPATH: it lies as
``LYING_SERVER`` says, then runs ``mpi_fnas.run`` unchanged. The parties run the real code.

* ``cap`` (the default): it plans and announces every configured step, whatever ``privacy.max_epsilon`` allows
  (tests/test_party_ledger.py);
* ``run_dir``: it names the run directory ``LYING_SERVER_DIR`` to the parties, whatever they were launched with,
  and sends the config pinned under the directory they name (tests/test_party_checks.py);
* ``one_party_plan``: party 1's search assignment gets one more step per epoch than the others' (the same; a DP
  party's own step check would refuse it before the parties compare plans, so the test runs it without DP);
* ``low_sigma``: every search assignment with half the σ_W the config derives (the same);
* ``other_network``: every augmentation assignment names ``cnn-gn``, whatever the config says (the same);
* ``other_ops``: every augmentation assignment names a cell of ``sep_conv_5x5`` edges (the same);
* ``collective``: it chooses the collective exchange, whatever the config allows (the same);
* ``exchange_text``: it sends a config whose ``runtime.exchange`` is collective, whatever the launch says, and
  keeps the star for now (a pin holding collective would let a later resume take it; the same);
* ``split_pattern``: it tells party 1 the collective exchange and every other party the star (the same);
* ``unparseable``: it sends config text that a party's own validation rejects (``search.order: second_order``
  under DP), and runs the honest config itself (the same);
* ``restart``: on ``--resume`` it sends every party checkpoint step 0, as if the run had never checkpointed (a
  rank 0 that feigns interruptions would have an uncapped party release its plan again at every relaunch; the same);
* ``steps``: every search assignment with ten times the configured epochs' steps (the same: no ε target or cap).
"""

from __future__ import annotations

import os
import sys

# MPI_Init first, on every rank: MPICH's MPI_Init spins until every rank has reached it, so parties that reached it
# while rank 0 imported torch and its planner below would each burn a core for those seconds.
from mpi4py import MPI

if MPI.COMM_WORLD.Get_rank() == 0:
    LIE = os.environ.get("LYING_SERVER", "cap")
    from mpi_fnas import run
    from mpi_fnas.privacy import calibration
    from mpi_fnas.stages import augment, rank0_driver, search

    if LIE == "cap":
        calibration._steps_within = lambda budget, shards, planned: planned
        rank0_driver.last_step_within_cap = lambda ledger, name, first, planned: (planned, None)
    elif LIE == "run_dir":
        from mpi_fnas.privacy.trusted_config import pin_directory, read_pin

        def named_elsewhere(cfg, args, made):
            own = args.resume or args.augment or args.out
            return read_pin(pin_directory(own, 1)), os.environ["LYING_SERVER_DIR"], "search"

        run.decide_launch = named_elsewhere
    elif LIE == "one_party_plan":
        honest = search.plan_run  # the search stage holds its own reference, imported above

        def one_party_changed(*args, **kwargs):
            planned = honest(*args, **kwargs)
            planned.assignments[0].steps_per_epoch += 1
            return planned

        search.plan_run = augment.plan_run = one_party_changed  # each stage holds its own reference
    elif LIE == "low_sigma":
        honest = search.plan_run

        def halved_sigma(*args, **kwargs):
            planned = honest(*args, **kwargs)
            for assignment in planned.assignments:
                assignment.dp = assignment.dp.with_noise(assignment.dp.noise_multiplier_w / 2,
                                                         assignment.dp.noise_multiplier_a)
            return planned

        search.plan_run = augment.plan_run = halved_sigma
    elif LIE in ("other_network", "other_ops"):
        honest_augment = augment.plan_augment_stage
        LARGER = ("normal=sep_conv_5x5@0,sep_conv_5x5@1|sep_conv_5x5@0,sep_conv_5x5@1;normal_concat=2,3;"
                  "reduce=sep_conv_5x5@0,sep_conv_5x5@1|sep_conv_5x5@0,sep_conv_5x5@1;reduce_concat=2,3")

        def other_network(*args, **kwargs):
            planned = honest_augment(*args, **kwargs)
            for assignment in planned.assignments:
                if LIE == "other_network":
                    assignment.network = "cnn-gn"
                else:
                    assignment.genotype = LARGER
            return planned

        augment.plan_augment_stage = other_network
    elif LIE == "steps":
        honest = search.plan_run

        def ten_times_the_steps(*args, **kwargs):
            planned = honest(*args, **kwargs)
            planned.steps *= 10
            for assignment in planned.assignments:
                assignment.steps = planned.steps
            return planned

        search.plan_run = ten_times_the_steps
    elif LIE == "exchange_text":
        from mpi_fnas.federation import topology

        honest_launch = run.decide_launch

        def collective_text(cfg, args, made):
            text, path, stage = honest_launch(cfg, args, made)
            return text.replace("exchange: star", "exchange: collective"), path, stage

        run.decide_launch = collective_text
        topology.choose_exchange = lambda cfg, facts: (topology.STAR, "a lying rank 0")
    elif LIE == "unparseable":
        honest_launch, honest_parse = run.decide_launch, run.config_from_text

        def invalid_text(cfg, args, made):
            text, path, stage = honest_launch(cfg, args, made)
            return text.replace("order: first_order", "order: second_order"), path, stage

        run.decide_launch = invalid_text
        run.config_from_text = lambda text, *args, **kwargs: honest_parse(
            text.replace("order: second_order", "order: first_order"), *args, **kwargs)
    elif LIE == "restart":
        from mpi_fnas.federation import job_plan

        plan_module_attach = job_plan.attach_resume

        def from_zero(plan, checkpoint):
            plan_module_attach(plan, checkpoint)
            for assignment in plan.assignments:
                assignment.checkpoint_step = 0

        rank0_driver.attach_resume = from_zero
    elif LIE == "split_pattern":
        from mpi_fnas import cli
        from mpi_fnas.federation.topology import COLLECTIVE, STAR

        def split(channel, cfg, own, facts, pending=None):
            channel.scatter_objects([None] + [["ok", [COLLECTIVE if rank == 1 else STAR, "a lying rank 0"]]
                                              for rank in range(1, channel.size)])
            channel.gather_objects(None)
            channel.pattern, channel.pattern_reason = STAR, "a lying rank 0"
            return "exchange: star (a lying rank 0)"

        cli.agree_on_exchange = split
    elif LIE == "collective":
        from mpi_fnas.federation import topology

        topology.choose_exchange = lambda cfg, facts: (topology.COLLECTIVE, "a lying rank 0")
    else:
        raise SystemExit(f"lying_server: unknown lie {LIE!r}")

from mpi_fnas.run import main

sys.exit(main())
