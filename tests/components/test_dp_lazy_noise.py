"""Lazy noise on embedding tables (dp_sgd's module docstring, "Lazy noise"): the trained model
has the law of eager dense noising, callbacks see a materialised model, the forward pass
reads the rows with their pending noise added, and tables it would not be exact for keep
eager noise."""
from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf
from scipy import stats

from sage_tfx.components.dp_trainer import dp_sgd

TRIALS, LOCAL_ROWS, WIDTH = 3000, 4, 2
# Which local rows each step gathers, as (row, weight): row 0 every step, row 1 at steps 1
# and 3, row 2 as a dummy (weight 0) at step 2 and as a record at the last step, row 3 never.
READS = [[(0, 1.0)], [(0, 1.0), (1, 1.0)], [(0, 1.0), (2, 0.0)], [(0, 1.0), (1, 1.0)],
         [(0, 1.0), (2, 1.0)]]
LABEL = 3.0  # far from the rows' start (0) against clip 1: clipping bites, depending on the noise
P_FLOOR = 1e-4  # per test of one row: false failure <= 5e-4 for the 5 tests of a correct step


def embedding_model(rows: int, width: int) -> tf.keras.Model:
    return tf.keras.Sequential([
        tf.keras.Input((1,), dtype="int32"),
        tf.keras.layers.Embedding(rows, width, embeddings_initializer="zeros"),
        tf.keras.layers.Flatten()])


def trained_rows(seed: int, lazy_noise: bool = True) -> np.ndarray:
    """The table after the steps of READS, [TRIALS, LOCAL_ROWS, WIDTH], noise multiplier 1,
    clip 1, learning rate 1, normaliser 1 (one step's noise has std 1 per parameter).

    Batched as the audit's DP-SGD adapter is: trial i owns rows [4 i, 4 i + 4) and each step
    holds one example per (trial, row read), reading its own row only. Clipping is per example
    and the noise per parameter, so the trials are independent runs of the 4-row model."""
    model = embedding_model(TRIALS * LOCAL_ROWS, WIDTH)
    ids = np.arange(TRIALS * LOCAL_ROWS, dtype=np.int32).reshape(TRIALS, LOCAL_ROWS)
    width = max(len(step) for step in READS) * TRIALS
    plan_rows, plan_weights = [], []
    for step in READS:
        rows = np.concatenate([ids[:, row] for row, _ in step])
        weights = np.concatenate([np.full(TRIALS, weight, np.float32) for _, weight in step])
        padding = width - len(rows)  # weight-0 slots reading row 0 again (a duplicate id)
        plan_rows.append(np.concatenate([rows, ids[:padding, 0]]))
        plan_weights.append(np.concatenate([weights, np.zeros(padding, np.float32)]))
    plan = dp_sgd.StepPlan(np.stack(plan_rows), np.stack(plan_weights), normaliser=1.0,
                           epochs=1)
    step = dp_sgd.make_dp_step(model, tf.keras.losses.MeanSquaredError(),
                               tf.constant(ids.reshape(-1, 1)),
                               tf.fill([TRIALS * LOCAL_ROWS, WIDTH], LABEL),
                               dp_sgd.DPSGDConfig(1.0, 1.0, 1.0), plan.normaliser,
                               dp_sgd.noise_generator(seed), lazy_noise=lazy_noise)
    assert dp_sgd.run_steps(step, plan) == len(READS)
    # One coordinate per row: the two coordinates of a row share its clip factor.
    return model.layers[0].embeddings.numpy().reshape(TRIALS, LOCAL_ROWS, WIDTH)[:, :, 0]


@pytest.fixture(scope="module")
def eager_rows():
    """The reference: every parameter noised at every step."""
    return trained_rows(seed=11, lazy_noise=False)


def law_p_values(lazy: np.ndarray, eager: np.ndarray) -> list[float]:
    """Two-sample Kolmogorov-Smirnov p-values, lazy against eager, of each local row, and the
    never-read row against its exact law N(0, steps)."""
    return [stats.ks_2samp(lazy[:, row], eager[:, row]).pvalue for row in range(LOCAL_ROWS)] + [
        stats.kstest(lazy[:, 3] / np.sqrt(len(READS)), "norm").pvalue]


def test_lazy_noise_has_the_law_of_eager_noise(eager_rows):
    # Rows read at every step, at two steps, as a dummy then a record at the last step, and
    # never: each row's final value (3,000 independent runs) has the eager law. P_FLOOR per
    # test; the broken variants below give p < 1e-20 on these runs.
    assert dp_sgd.lazy_tables(embedding_model(8, WIDTH), tf.zeros([1, 1], tf.int32))
    p_values = law_p_values(trained_rows(seed=12), eager_rows)
    assert min(p_values) > P_FLOOR, p_values


@pytest.mark.parametrize("broken", ["no final materialisation", "k steps' noise as 1 step's",
                                    "sqrt(k) taken as k"])
def test_the_law_test_catches_a_broken_lazy_noise(broken, eager_rows, monkeypatch):
    if broken == "no final materialisation":
        monkeypatch.setattr(dp_sgd.TrainingStep, "materialise", lambda self: None)
    elif broken == "k steps' noise as 1 step's":
        monkeypatch.setattr(dp_sgd, "pending_noise_scale",
                            lambda pending: tf.cast(pending > 0, tf.float32))
    else:
        monkeypatch.setattr(dp_sgd, "pending_noise_scale",
                            lambda pending: tf.cast(pending, tf.float32))
    assert min(law_p_values(trained_rows(seed=12), eager_rows)) < P_FLOOR


def test_callbacks_and_the_caller_see_every_rows_noise(monkeypatch):
    # Only row 0 is ever read: the other 20,000 rows (width 1) hold nothing but noise, after t
    # steps N(0, t) each (noise multiplier 1, clip 1, learning rate 1, normaliser 1). Their
    # mean square within 10% of t: 10 standard errors (chi-square with 20,000 dof), so no
    # false failure in practice; a model with pending noise shows t - 1 steps' or none.
    rows, steps = 20_001, 4
    model = embedding_model(rows, 1)
    plan = dp_sgd.StepPlan(np.zeros((steps, 2), np.int32), np.ones((steps, 2), np.float32),
                           normaliser=1.0, epochs=2)
    seen = []

    def noise_power(_=None):
        seen.append(float(np.mean(model.layers[0].embeddings.numpy()[1:] ** 2)))

    dp_sgd.train(model, tf.keras.losses.MeanSquaredError(), tf.zeros([1, 1], tf.int32),
                 tf.zeros([1, 1]), plan, dp_sgd.DPSGDConfig(1.0, 1.0, 1.0), seed=3,
                 on_step=noise_power, on_epoch=lambda epoch, loss: noise_power())
    noise_power()  # after train returned
    # on_step after steps 1, 2; on_epoch after 2; on_step after 3, 4; on_epoch after 4; return.
    assert seen == pytest.approx([1, 2, 2, 3, 4, 4, 4], rel=0.1)

    # A loop that stops on an exception leaves a materialised model too.
    model = embedding_model(rows, 1)
    seen.clear()

    def stop_after_two(ran):
        if ran == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        dp_sgd.train(model, tf.keras.losses.MeanSquaredError(), tf.zeros([1, 1], tf.int32),
                     tf.zeros([1, 1]), plan, dp_sgd.DPSGDConfig(1.0, 1.0, 1.0), seed=3,
                     progress=stop_after_two)
    noise_power()
    assert seen == pytest.approx([2], rel=0.1)


def test_the_forward_pass_reads_a_row_with_its_pending_noise():
    # Row 0 read at steps 0 and 2, row 1 at step 1: at step 2 row 0 carries 2 steps of
    # pending noise (std 10 each: noise multiplier 1, clip 100, learning rate 0.1), which must
    # be added before the forward pass reads it. No clipping (|gradient| << 100), so step 2
    # moves row 0 from its read value v to v - 0.1 * 2 (v - y) = 0.8 v + 0.2 y, and its
    # returned loss is (v - y)^2: the loss and the row after the step must agree on v.
    # (Read before the noise is added, they disagree by the noise, std 14.)
    label = 2.0
    model = embedding_model(2, 1)
    step = dp_sgd.make_dp_step(model, tf.keras.losses.MeanSquaredError(),
                               tf.constant([[0], [1]]), tf.fill([2, 1], label),
                               dp_sgd.DPSGDConfig(1.0, 100.0, 0.1), 1.0,
                               dp_sgd.noise_generator(4))
    for row in (0, 1):
        step(tf.constant([row]), tf.constant([1.0]))
    loss, _ = step(tf.constant([0]), tf.constant([1.0]))
    after = float(model.layers[0].embeddings[0, 0])  # step 2's own noise is still pending
    read = (after - 0.2 * label) / 0.8
    assert float(loss) == pytest.approx((read - label) ** 2, rel=1e-4)


class TiedOutput(tf.keras.layers.Layer):
    """Logits against every row of an embedding table (weight tying): a dense read."""

    def __init__(self, embedding, **kwargs):
        super().__init__(**kwargs)
        self._table = lambda: embedding.embeddings  # not tracked: its variable stays single-owned

    def call(self, inputs):
        return tf.matmul(inputs, self._table(), transpose_b=True)


def test_tables_read_otherwise_than_by_their_gather_keep_eager_noise():
    features = tf.zeros([1, 1], tf.int32)
    assert dp_sgd.lazy_tables(embedding_model(10, 2), features)
    constrained = tf.keras.Sequential([
        tf.keras.Input((1,), dtype="int32"),
        tf.keras.layers.Embedding(10, 2, embeddings_constraint=tf.keras.constraints.MaxNorm(1.0))])
    assert not dp_sgd.lazy_tables(constrained, features)
    inputs = tf.keras.Input((1,), dtype="int32")
    embedding = tf.keras.layers.Embedding(10, 2)
    tied = tf.keras.Model(inputs, TiedOutput(embedding)(tf.keras.layers.Flatten()(
        embedding(inputs))))
    assert not dp_sgd.lazy_tables(tied, features)
    dense = tf.keras.Sequential([tf.keras.Input((3,)), tf.keras.layers.Dense(2)])
    assert not dp_sgd.lazy_tables(dense, tf.zeros([1, 3]))


def test_ids_that_training_changes_keep_eager_noise():
    """A Dropout before the table gathers, in training, other rows than an inference-mode
    trace lists (a reviewer's case: rows read without their pending noise). Ids sliced and
    cast from a wider input stay lazy."""
    def table_after(*layers, width=1):
        return tf.keras.Sequential([tf.keras.Input((width,)), *layers,
                                    tf.keras.layers.Embedding(20, 2), tf.keras.layers.Flatten()])
    features = tf.constant([[3.0, 1.0], [4.0, 2.0]])
    assert not dp_sgd.lazy_tables(table_after(tf.keras.layers.Dropout(0.5)), features[:, :1])
    assert not dp_sgd.lazy_tables(table_after(tf.keras.layers.GaussianNoise(1.0)),
                                  features[:, :1])
    inputs = tf.keras.Input((2,))
    ids = tf.cast(inputs[:, 0], tf.int32)
    sliced = tf.keras.Model(inputs, tf.keras.layers.Embedding(20, 2)(ids))
    assert len(dp_sgd.lazy_tables(sliced, features)) == 1


def test_lazy_noise_is_keyed_by_the_seed():
    def trained(seed):
        model = embedding_model(50, 2)
        model.set_weights([np.zeros((50, 2), np.float32)])
        plan = dp_sgd.StepPlan(np.array([[0, 1], [2, 0], [1, 3]], np.int32),
                               np.ones((3, 2), np.float32), normaliser=2.0, epochs=1)
        dp_sgd.train(model, tf.keras.losses.MeanSquaredError(),
                     tf.constant([[3], [7], [7], [40]]), tf.ones([4, 2]), plan,
                     dp_sgd.DPSGDConfig(1.0, 1.0, 0.5), seed=seed)
        return model.get_weights()[0]

    first = trained(7)
    assert np.array_equal(first, trained(7))
    assert not np.array_equal(first, trained(8))


def test_an_embedding_fed_float_ids_trains_lazily():
    """DPTrainer's decoder gives every feature as float32: the stand-in check must not feed
    the Embedding a negative id (-2 used to fail every such model, before the charge in the
    BlockLedger's preflight and at train()), and the table is still noised lazily."""
    model = tf.keras.Sequential([
        tf.keras.Input((1,), dtype="float32"),
        tf.keras.layers.Embedding(50, 2, embeddings_initializer="zeros"),
        tf.keras.layers.Flatten()])
    features = tf.constant([[3.0], [7.0], [7.0], [40.0]])
    assert len(dp_sgd.lazy_tables(model, features)) == 1
    plan = dp_sgd.StepPlan(np.array([[0, 1], [2, 0], [1, 3]], np.int32),
                           np.ones((3, 2), np.float32), normaliser=2.0, epochs=1)
    assert dp_sgd.train(model, tf.keras.losses.MeanSquaredError(), features, tf.ones([4, 2]),
                        plan, dp_sgd.DPSGDConfig(1.0, 1.0, 0.5), seed=1) == 3
    assert np.all(model.get_weights()[0] != 0)  # every row noised, read or not


def test_ids_reshaped_onto_the_batch_axis_are_counted_per_example():
    """Three ids per example reshaped to one per row (tf.reshape(x, [-1, 1]), an allowed id
    op): the ids layer's output shape says one id per example, but a batch of 4 gathers 12,
    so the noise a step reserves (most_touched) counts 12 rows, not 4 (a step whose take
    outran its reservation would fail, after the charge)."""
    inputs = tf.keras.Input((3,), dtype="int32")
    rows = tf.keras.layers.Embedding(100, 2)(tf.reshape(inputs, [-1, 1]))
    model = tf.keras.Model(inputs, tf.keras.layers.Dense(1)(tf.reshape(rows, [-1, 6])))
    features = tf.constant(np.arange(12, dtype=np.int32).reshape(4, 3))
    (table,) = dp_sgd.lazy_tables(model, features)
    assert table.ids_per_row == 3 and table.most_touched(4) == 12
    assert table.most_touched(1_000) == 100  # never more than the table's rows
