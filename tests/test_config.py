"""Config schema: defaults, YAML files, --set overrides, one-line errors naming the key."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import yaml
from pre_recipe import PRE_RECIPE

from mpi_fnas.config import (
    Config,
    ConfigError,
    check_world,
    config_from_text,
    describe_keys,
    documented_defaults_yaml,
    key_docs,
    load_config,
)
from mpi_fnas.op_names import DPNAS_CONVS

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))


def test_default_yaml_is_exactly_the_built_in_default():
    """configs/default.yaml documents the defaults; the wheel relies on the schema, so they must agree."""
    from_file = load_config(ROOT / "configs" / "default.yaml")
    assert from_file == Config()
    assert yaml.safe_load((ROOT / "configs" / "default.yaml").read_text()) == Config().to_dict()


def test_default_yaml_is_the_generated_documented_copy():
    """Values *and* comments come from the schema; after changing a meaning, regenerate the file."""
    text = (ROOT / "configs" / "default.yaml").read_text(encoding="utf-8")
    assert text == documented_defaults_yaml(), (
        "configs/default.yaml is stale; regenerate it with: python -c \"from mpi_fnas.config import "
        "documented_defaults_yaml as d; open('configs/default.yaml', 'w', encoding='utf-8').write(d())\""
    )
    for doc in key_docs():  # every key's meaning is written above it as a comment
        leaf = doc.key.rsplit(".", 1)[-1]
        first_words = " ".join(doc.meaning.split()[:4])
        assert f"# {first_words}" in text, doc.key
        assert f"{leaf}:" in text, doc.key


def test_every_key_has_a_meaning_and_help_prints_it():
    docs = key_docs()
    keys = [doc.key for doc in docs]
    leaves = [f"{section}.{key}" if isinstance(value, dict) else section
              for section, value in Config().to_dict().items() for key in (value if isinstance(value, dict) else [0])]
    assert keys == leaves
    for doc in docs:
        assert doc.meaning.strip(), f"{doc.key} has no meaning in the schema"
        assert "\n" not in doc.meaning, doc.key
    help_text = "\n".join(describe_keys())
    flat = " ".join(help_text.split())
    for doc in docs:
        assert f"  {doc.key} " in help_text, doc.key
        assert " ".join(doc.meaning.split()) in flat, doc.key  # the whole meaning, however it is wrapped
    assert re.search(r"^  data\.download +bool  \(default false\)$", help_text, re.M)
    assert re.search(r"^  augment\.steps_per_epoch +int or null  \(default null\)$", help_text, re.M)
    # A key line is followed by its meaning, indented: key, type, default and meaning read together.
    lines = describe_keys()
    at = next(i for i, line in enumerate(lines) if line.startswith("  search.batch_size "))
    assert f"(default {Config().search.batch_size})" in lines[at]
    assert lines[at + 1].startswith("      examples per party and step")


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_loads(path):
    if "sweep" in yaml.safe_load(path.read_text()):  # a sweep file: base config + sweep section
        from mpi_fnas.sweep import load_sweep

        cfg, spec = load_sweep(path)
        assert spec.points()
    else:
        cfg = load_config(path)
    assert cfg.mode in ("vanilla", "fnas", "dpfnas")


def test_required_configs_exist():
    names = {p.name for p in CONFIGS}
    assert {"default.yaml", "vanilla_nas.yaml", "fnas.yaml", "cifar10_fnas.yaml"} <= names


def test_overrides_are_parsed_as_yaml_and_applied_last(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("search:\n  epochs: 7\n  w_lr: 0.1\n")
    cfg = load_config(f, ["mode=fnas", "search.epochs=2", "space.kind=darts", "space.ops=[]", "space.norm=batchnorm",
                          "federation.parties=null",
                          "runtime.progress=off", "data.download=true"])
    assert cfg.search.epochs == 2
    assert cfg.search.w_lr == 0.1
    assert cfg.space.norm == "batchnorm"
    assert cfg.runtime.progress == "off"  # YAML reads `off` as False; the schema maps it back
    assert cfg.data.download is True


def test_int_is_accepted_for_float_but_not_the_reverse():
    assert load_config(None, ["search.w_lr=1"]).search.w_lr == 1.0
    with pytest.raises(ConfigError, match=r"^search\.epochs: expected an integer, got 2\.5$"):
        load_config(None, ["search.epochs=2.5"])


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("search.epoch=3", r"^search\.epoch: unknown key \(valid keys here: epochs, "),
        ("bogus=1", r"^bogus: unknown key"),
        ("search.epochs=0", r"^search\.epochs: 0 must be >= 1$"),
        ("search.epochs=three", r"^search\.epochs: expected an integer, got 'three'$"),
        ("mode=dp", r"^mode: 'dp' is not one of 'vanilla', 'fnas', 'dpfnas'$"),
        ("data.val_fraction=1.0", r"^data\.val_fraction: 1\.0 must be in \(0, 1\)$"),
        ("search.w_lr=.inf", r"^search\.w_lr: expected a finite number"),
        ("search.w_lr_min=1.0", r"^search\.w_lr_min: 1\.0 must not exceed search\.w_lr"),
        ("search=3", r"^search: expected a mapping"),
        ("search.epochs.x=1", r"^search\.epochs: expected an integer, got \{.x.: 1\}$"),
        ("data=[1]", r"^data: expected a mapping"),
        ("noequals", r"expected dotted\.key=value"),
        ("data.download=yes please", r"^data\.download: expected true or false"),
        ("name=a/b", r"^name: 'a/b' must be a non-empty name without path separators$"),
        ("privacy.secure_rng=true", r"^privacy\.secure_rng: removed: every DP party now draws all its noise .* "
                                    r"delete the key$"),
        ("privacy.secure_rng=false", r"^privacy\.secure_rng: removed"),
        ("privacy.search_share=0.5", r"^privacy\.search_share divides privacy\.target_epsilon between the stages"),
    ],
)
def test_bad_input_is_one_line_naming_the_key(override, message):
    with pytest.raises(ConfigError, match=message) as info:
        load_config(None, [*PRE_RECIPE, override])
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["augment.network=cnn-relu"], r"^augment\.network: 'cnn-relu' is not one of 'cell', 'cnn-tanh', 'cnn-gn', "
         r"'scatter-linear', 'scatter-cnn'$"),
        (["augment.network=cnn-tanh", "augment.genotype=normal=skip_connect@0"],
         r"^augment\.genotype: augment\.network cnn-tanh trains a hand-designed network, not a cell"),
        (["augment.network=cnn-gn", "augment.drop_path=0.2"], r"^augment\.drop_path: augment\.network cnn-gn has no "
                                                              r"cell paths to drop; set it to 0$"),
        (["augment.network=cnn-gn", "augment.auxiliary_weight=0.4"], r"^augment\.auxiliary_weight: augment\.network "
                                                                     r"cnn-gn has no auxiliary head; set it to 0$"),
    ],
)
def test_a_hand_designed_network_refuses_what_only_a_cell_has(overrides, message):
    with pytest.raises(ConfigError, match=message) as info:
        load_config(None, [*PRE_RECIPE, *overrides])
    assert "\n" not in str(info.value)
    assert load_config(None, ["augment.network=cnn-tanh"]).augment.network == "cnn-tanh"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["augment.network=scatter-linear", "augment.cutout=16"],
         r"^augment\.cutout: augment\.network scatter-linear computes each example's scattering once, so its "
         r"images cannot be augmented per step; set augment\.cutout and augment\.crop_padding to 0 and "
         r"augment\.flip to false$"),
        (["space.stem=scattering", "augment.flip=true"],
         r"^augment\.flip: space\.stem scattering transforms each example once, so its images cannot be augmented "
         r"per step; set augment\.cutout and augment\.crop_padding to 0 and augment\.flip to false, or set "
         r"space\.stem: conv$"),
        (["space.stem=search", "augment.crop_padding=2"],
         r"^augment\.crop_padding: space\.stem search may choose the scattering stem"),
    ],
)
def test_a_scattering_front_end_refuses_augmenting_its_images_per_step(overrides, message):
    """The scattering is computed once per example before the augmentation: a crop, flip or cutout would act on its
    7x7 features. The conv stem's cell keeps them."""
    base = ROOT / "configs" / "mnist28_scattering_stem.yaml"
    with pytest.raises(ConfigError, match=message) as info:
        load_config(base, overrides)
    assert "\n" not in str(info.value)
    conv = load_config(base, ["space.stem=conv", "augment.flip=true", "augment.cutout=8"])
    assert (conv.augment.flip, conv.augment.cutout) == (True, 8)


def test_a_stored_config_of_an_older_version_is_read_without_its_removed_keys():
    """Logs, checkpoints and searched.pt written before privacy.secure_rng was removed still read (report, sweep,
    --resume, --augment); a config the user gives does not."""
    old = Config().to_dict()
    old["privacy"]["secure_rng"] = False
    text = yaml.safe_dump(old, sort_keys=False)
    assert config_from_text(text, stored=True) == Config()
    with pytest.raises(ConfigError, match=r"^privacy\.secure_rng: removed"):
        config_from_text(text)


@pytest.mark.parametrize("kind", ["darts", "dpnas"])
def test_a_stored_config_from_before_space_ops_keeps_every_op(kind: str):
    """A log, checkpoint or searched.pt written before space.ops existed searched every op of its space: read back
    (--resume, --augment, a party's pinned config, the report), it must mean that, not today's default of the six
    DPNAS convolutions (which a DARTS config would refuse, and a DPNAS one would silently shrink)."""
    old = load_config(None, [*PRE_RECIPE, f"space.kind={kind}"]).to_dict()
    del old["space"]["ops"]
    text = yaml.safe_dump(old, sort_keys=False)
    assert config_from_text(text, stored=True).space.ops == []
    assert config_from_text(text, stored=True) == load_config(None, [*PRE_RECIPE, f"space.kind={kind}"])
    if kind == "darts":  # given by the user, the same text takes today's default, and says what to set
        with pytest.raises(ConfigError, match=r"^space\.ops: the default names dpnas' six convolutions"):
            config_from_text(text)
    stored = Config().to_dict()  # a stored config that has the key keeps its value
    assert config_from_text(yaml.safe_dump(stored, sort_keys=False), stored=True) == Config()


def test_bad_files(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("search: [1, 2\n")
    with pytest.raises(ConfigError, match=r"not valid YAML at line \d+"):
        load_config(bad)
    scalar = tmp_path / "scalar.yaml"
    scalar.write_text("3\n")
    with pytest.raises(ConfigError, match="mapping at the top level"):
        load_config(scalar)


def test_world_size_decides_the_party_count():
    cfg = load_config(None, [])
    assert check_world(cfg, 9) == 8
    with pytest.raises(ConfigError, match=r"at least 2 MPI ranks.*mpirun -n 9"):
        check_world(cfg, 1)
    pinned = load_config(None, ["federation.parties=4"])
    assert check_world(pinned, 5) == 4
    with pytest.raises(ConfigError, match=r"^federation\.parties: config says 4 but the MPI world has 8"):
        check_world(pinned, 9)
    vanilla = load_config(None, ["mode=vanilla"])
    assert check_world(vanilla, 2) == 1
    with pytest.raises(ConfigError, match="exactly 2 ranks"):
        check_world(vanilla, 3)


def test_resolved_yaml_round_trips(tmp_path):
    cfg = load_config(None, ["search.epochs=3", "data.partition=dirichlet"])
    f = tmp_path / "resolved.yaml"
    f.write_text(cfg.to_yaml())
    assert load_config(f) == cfg


def test_mnist_recipe_config_carries_the_private_recipe():
    """configs/mnist_recipe.yaml is configs/mnist.yaml plus the private recipe (docs/log/benchmarks.md): the DPNAS
    space, a party's whole mnist-5k pool per step (q = 1), 80 epochs, lr 2; a search whose batch is a party's whole
    search half, at w_lr 2 and a_lr 0.1; everything else the make-run default."""
    recipe = load_config(ROOT / "configs" / "mnist_recipe.yaml")
    mnist = load_config(ROOT / "configs" / "mnist.yaml")
    assert recipe.data == mnist.data
    assert recipe.space.kind == "dpnas"
    assert (recipe.augment.batch_size, recipe.augment.epochs, recipe.augment.lr) == (500, 80, 2.0)
    # the pool of a party: mnist-5k's 4,000 train digits over the make-run's 8 parties, so B / N = 1
    assert recipe.augment.pool == "all" and recipe.augment.batch_size == 4000 // 8
    assert recipe.privacy.aggregation == "secure"
    # the search half of a party's pool (DARTS splits the shard into W and A halves), so the search's q is 1 too
    assert (recipe.search.batch_size, recipe.search.w_lr, recipe.search.a_lr) == (4000 // 8 // 2, 2.0, 0.1)
    defaults = Config()
    assert (recipe.augment.clip, recipe.augment.momentum, recipe.space.stage_channels, recipe.space.nodes) == (
        defaults.augment.clip, defaults.augment.momentum, defaults.space.stage_channels, defaults.space.nodes)


def test_full_mnist_recipe_config_is_the_default_recipe_on_the_full_set():
    """configs/mnist_full_recipe.yaml: the full MNIST at 14x14 (as configs/mnist.yaml pools mnist-5k) with the
    built-in default's private recipe and an augmentation batch of 250 of a party's 7,500 digits (q = 1/30),
    docs/log/benchmarks.md's choice; everything else, σ calibrated to a worst-party ε of 3 included, the default."""
    full = load_config(ROOT / "configs" / "mnist_full_recipe.yaml")
    assert (full.data.dataset, full.data.image_size, full.data.train_size, full.data.test_size) == ("mnist", 14, None,
                                                                                                   None)
    assert full.augment.batch_size == 250  # of a party's 60,000 / 8 = 7,500 digits: q = 1/30
    defaults = Config()
    assert (full.space, full.search) == (defaults.space, defaults.search)
    assert (full.augment.epochs, full.augment.lr, full.privacy) == (defaults.augment.epochs, defaults.augment.lr,
                                                                    defaults.privacy)
    assert full.privacy.target_epsilon == 3.0 and full.privacy.aggregation == "secure"


def test_the_28x28_configs_differ_from_the_full_mnist_recipe_only_where_they_say():
    """configs/mnist28.yaml is configs/mnist_full_recipe.yaml at the digits' own 28x28 with a stride-2 stem (the cells
    run at 14x14) and the DPNAS network's MNIST widths at lr 1; configs/mnist28_tanh.yaml trains the hand-designed
    tanh CNN there, no search, at the same ε."""
    full = load_config(ROOT / "configs" / "mnist_full_recipe.yaml")
    cell = load_config(ROOT / "configs" / "mnist28.yaml")
    tanh = load_config(ROOT / "configs" / "mnist28_tanh.yaml")
    for cfg in (cell, tanh):
        assert (cfg.data.dataset, cfg.data.image_size, cfg.data.train_size, cfg.data.test_size) == ("mnist", 28,
                                                                                                    None, None)
        assert cfg.privacy == full.privacy and cfg.privacy.target_epsilon == 3.0
        assert cfg.privacy.aggregation == "secure" and cfg.search == full.search
    assert cell.space == dataclasses.replace(full.space, stem_stride=2, stage_channels=[32, 32, 64])
    assert cell.augment == dataclasses.replace(full.augment, lr=1.0)
    assert tanh.augment == dataclasses.replace(full.augment, network="cnn-tanh") and tanh.space == full.space


def test_the_built_in_default_is_the_synthetic_recipe():
    """The built-in default (what `make run` runs) is the private recipe measured on the default data, and
    configs/synthetic_recipe.yaml spells it out: the DPNAS space with its six convolutions, a search of batch 250 at
    w_lr 2 and a_lr 0.1, the augmentation's batch 500 x 20 epochs at lr 2, secure aggregation, σ calibrated to a
    worst-party ε of 3 for search + augmentation."""
    defaults = Config()
    assert defaults.mode == "dpfnas" and defaults.space.kind == "dpnas" and defaults.space.ops == list(DPNAS_CONVS)
    assert (defaults.search.batch_size, defaults.search.w_lr, defaults.search.a_lr) == (250, 2.0, 0.1)
    assert (defaults.augment.batch_size, defaults.augment.epochs, defaults.augment.lr) == (500, 20, 2.0)
    assert defaults.privacy.target_epsilon == 3.0 and defaults.privacy.aggregation == "secure"
    recipe = load_config(ROOT / "configs" / "synthetic_recipe.yaml")
    assert dataclasses.replace(recipe, name=defaults.name) == defaults


def test_the_old_default_is_kept_as_a_config_and_the_tests_pin_the_same():
    """configs/darts_default.yaml is the built-in default before the private recipe, which the older measurements
    used; the tests written against it pin the same keys (tests/pre_recipe.py's PRE_RECIPE)."""
    old = load_config(ROOT / "configs" / "darts_default.yaml")
    assert dataclasses.replace(load_config(None, PRE_RECIPE), name=old.name) == old
    assert (old.space.kind, old.space.ops, old.search.batch_size, old.augment.lr) == ("darts", [], 16, 0.3)


def test_a_darts_run_from_the_defaults_is_told_to_set_its_ops():
    """The default `space.ops` names DPNAS ops: a config that switches to DARTS alone gets one line saying what to
    set, not the list of every op."""
    with pytest.raises(ConfigError, match=r"^space\.ops: the default names dpnas' six convolutions, and space\.kind "
                                          r"is darts; set space\.ops: \[\] \(every DARTS op\)") as info:
        load_config(None, ["space.kind=darts"])
    assert "\n" not in str(info.value)
    assert load_config(None, ["space.kind=darts", "space.ops=[]"]).space.ops == []


def test_the_fashion_mnist_configs_are_the_mnist_ones_on_the_other_dataset_and_the_scatternets_their_recipe():
    """configs/fmnist28.yaml is configs/mnist28.yaml on FashionMNIST; every hand arm trains without a search at the
    same ε; a ScatterNet arm keeps Tramèr & Boneh's recipe (40 epochs, clip 0.1, a constant lr with momentum 0.9,
    no weight decay, no image augmentation: its features are computed once); only the lr (and the tanh CNN's
    epochs: the papers train FashionMNIST for 40) differ between the two datasets, each chosen on a tuning seed."""
    def differences(a, b):
        flat_a, flat_b = _flatten(a.to_dict()), _flatten(b.to_dict())
        return {key for key in flat_a.keys() | flat_b.keys() if flat_a.get(key) != flat_b.get(key)}

    mnist, fashion = ("mnist28", "mnist"), ("fmnist28", "fashion-mnist")
    for stem, dataset in (mnist, fashion):
        for arm in ("", "_tanh", "_scatter_linear", "_scatter_cnn"):
            cfg = load_config(ROOT / "configs" / f"{stem}{arm}.yaml")
            assert (cfg.data.dataset, cfg.data.image_size, cfg.data.train_size, cfg.data.test_size,
                    cfg.data.holdout) == (dataset, 28, None, None, 0)
            assert cfg.privacy == Config().privacy and cfg.privacy.target_epsilon == 3.0, (stem, arm)
            if arm.startswith("_scatter"):
                augment = cfg.augment
                assert augment.network == arm[1:].replace("_", "-") and augment.epochs == 40 and augment.clip == 0.1
                assert augment.lr == augment.lr_min and augment.momentum == 0.9 and augment.weight_decay == 0
                assert (augment.cutout, augment.crop_padding, augment.flip) == (0, 0, False)
    base = {"name", "data.dataset"}
    assert differences(load_config(ROOT / "configs" / "mnist28.yaml"),
                       load_config(ROOT / "configs" / "fmnist28.yaml")) <= base | {"augment.lr",
                                                                                           "augment.epochs"}
    assert differences(load_config(ROOT / "configs" / "mnist28_tanh.yaml"),
                       load_config(ROOT / "configs" / "fmnist28_tanh.yaml")) <= base | {"augment.lr", "augment.epochs"}
    for arm in ("_scatter_linear", "_scatter_cnn"):
        assert differences(load_config(ROOT / "configs" / f"mnist28{arm}.yaml"),
                           load_config(ROOT / "configs" / f"fmnist28{arm}.yaml")) <= base | {"augment.lr",
                                                                                             "augment.lr_min"}


@pytest.mark.parametrize("dataset", ["fmnist28", "mnist28"])
def test_the_scattering_stem_config_is_the_searched_recipe_with_the_scatternets_front_end(dataset: str):
    """configs/<dataset>_scattering_stem.yaml changes configs/<dataset>.yaml's network only (the stem, the stages
    on the 7x7 features, the head left to the search) and the lr and length its tuning chose: the same search, ε and
    data; the two datasets' scattering-stem networks are the same."""
    searched = load_config(ROOT / "configs" / f"{dataset}.yaml")
    scattering = load_config(ROOT / "configs" / f"{dataset}_scattering_stem.yaml")
    flat_a, flat_b = _flatten(searched.to_dict()), _flatten(scattering.to_dict())
    changed = {key for key in flat_a.keys() | flat_b.keys() if flat_a.get(key) != flat_b.get(key)}
    length = {"augment.epochs"} if dataset == "fmnist28" else set()  # the conv stem's tuning chose 40, this one 20
    assert changed == {"name", "space.stem", "space.stem_stride", "space.stage_channels", "space.head",
                       "augment.lr"} | length
    assert (scattering.space.stem, scattering.space.head, scattering.space.stem_stride) == ("scattering", "search", 1)
    assert scattering.space == load_config(ROOT / "configs" / "fmnist28_scattering_stem.yaml").space


def _flatten(tree: dict, prefix: str = "") -> dict:
    flat: dict = {}
    for key, value in tree.items():
        flat.update(_flatten(value, f"{prefix}{key}.") if isinstance(value, dict) else {f"{prefix}{key}": value})
    return flat
