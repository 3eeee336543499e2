"""Acceptance 1: the logit-proxy weight equals Σ_t ‖∂ log p_t(y_t)/∂z_t‖² computed by autograd on the logits."""

import pytest
import torch

from oblr_trl.estimators.weights import (
    length_weights,
    log_sum_sq_probs,
    logit_gradient_sq_norms,
    logit_proxy_weights,
    uniform_weights,
)


def autograd_logit_weights(logits: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Σ_t mask_t ‖∂ log softmax(z_t)[y_t] / ∂z_t‖², token by token with autograd (the reference)."""
    batch, length, _ = logits.shape
    weights = torch.zeros(batch, dtype=torch.float64)
    for b in range(batch):
        for t in range(length):
            if not mask[b, t]:
                continue
            z = logits[b, t].detach().double().requires_grad_(True)
            (grad,) = torch.autograd.grad(torch.log_softmax(z, -1)[labels[b, t]], z)
            weights[b] += grad.pow(2).sum()
    return weights


def random_padded_batch(seed=0, batch=5, length=7, vocab=50, scale=3.0):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, length, vocab, generator=gen) * scale
    labels = torch.randint(0, vocab, (batch, length), generator=gen)
    lengths = torch.tensor([7, 4, 1, 0, 6])[:batch]
    mask = (torch.arange(length).expand(batch, -1) < lengths.unsqueeze(1)).int()
    return logits, labels, mask


def test_logit_proxy_matches_autograd_with_padding():
    logits, labels, mask = random_padded_batch()
    log_probs = torch.log_softmax(logits, -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    # padding positions carry garbage, as they can in a batch: they must not leak in
    log_probs = torch.where(mask.bool(), log_probs, torch.full_like(log_probs, float("nan")))
    weights = logit_proxy_weights(log_probs, log_sum_sq_probs(logits), mask)
    reference = autograd_logit_weights(logits, labels, mask)
    assert weights[3] == 0.0  # an empty completion
    rel_err = ((weights.double() - reference).abs() / reference.clamp(min=1e-12))[reference > 0]
    assert rel_err.max() < 1e-5


def test_log_sum_sq_probs_is_stable_for_peaked_logits():
    logits = torch.tensor([[1000.0, 0.0, -1000.0], [0.0, 0.0, 0.0]])
    expected = torch.log(torch.tensor([1.0, 1.0 / 3.0]))
    assert torch.allclose(log_sum_sq_probs(logits), expected, atol=1e-6)


def test_logit_gradient_sq_norms_is_non_negative_when_certain():
    log_probs = torch.tensor([[0.0, -1e-9]])
    log_sum_sq = torch.tensor([[0.0, -2e-9]])
    assert (logit_gradient_sq_norms(log_probs, log_sum_sq) >= 0).all()


def test_token_scale_weights_each_token():
    log_probs = torch.log(torch.tensor([[0.5, 0.25]]))
    log_sum_sq = torch.log(torch.tensor([[0.5, 0.3]]))
    mask = torch.ones(1, 2, dtype=torch.int64)
    scale = torch.tensor([[4.0, 0.0]])
    per_token = logit_gradient_sq_norms(log_probs, log_sum_sq)
    assert torch.allclose(logit_proxy_weights(log_probs, log_sum_sq, mask, scale), 4.0 * per_token[:, 0])
    assert torch.allclose(length_weights(mask, scale), torch.tensor([4.0]))
    assert torch.equal(length_weights(mask), torch.tensor([2.0]))
    assert torch.equal(uniform_weights(mask), torch.tensor([1.0]))


@pytest.mark.parametrize("architecture", ["llama", "qwen3"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_trainer_logit_weights_match_autograd_on_model_logits(make_trainer, tokenizer, architecture, temperature):
    """The trainer's weights, from TRL's fused LM head, equal autograd on the model's temperature-scaled logits."""
    from oblr_trl.testing import tiny_causal_lm

    model = tiny_causal_lm(tokenizer, architecture=architecture, tie_word_embeddings=architecture == "qwen3")
    trainer = make_trainer(model=model, temperature=temperature)
    prompts = [tokenizer(p).input_ids for p in ["1+2=", "33+4="]]
    completions = [tokenizer(c).input_ids for c in ["3<eos>", "37", ""]][:2] + [[]]
    prompts.append(tokenizer("5=").input_ids)
    prompt_ids = torch.nn.utils.rnn.pad_sequence(
        [torch.tensor(p).flip(0) for p in prompts], batch_first=True, padding_value=tokenizer.pad_token_id
    ).flip(1)
    prompt_mask = (prompt_ids != tokenizer.pad_token_id).int()
    width = max(len(c) for c in completions)
    completion_ids = torch.full((3, width), tokenizer.pad_token_id)
    completion_mask = torch.zeros(3, width, dtype=torch.int64)
    for i, c in enumerate(completions):
        completion_ids[i, : len(c)] = torch.tensor(c, dtype=torch.long)
        completion_mask[i, : len(c)] = 1
    output = {
        "prompt_ids": prompt_ids,
        "prompt_mask": prompt_mask,
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
    }
    weights = trainer.completion_weights.compute(output, None, "train")

    input_ids = torch.cat([prompt_ids, completion_ids], 1)
    attention_mask = torch.cat([prompt_mask, completion_mask], 1)
    with torch.no_grad():
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, -width - 1 : -1] / temperature
    reference = autograd_logit_weights(logits, completion_ids, completion_mask)
    assert weights[2] == 0.0
    assert torch.allclose(weights.double(), reference, rtol=1e-5, atol=0)


def test_weights_from_generation_logits_match_a_forward_pass(make_trainer):
    """The logits transformers' generate computed (with its KV cache) give the same weights as a fresh forward."""
    from oblr_trl import OBLRPOTrainer
    from oblr_trl.training.completion_weights import CompletionWeights

    pairs = []

    class BothSourcesWeights(CompletionWeights):
        def compute(self, output, record, mode, measure=None):
            used = super().compute(output, record, mode, measure)  # takes the captured generation logits
            assert record.take() == (None, None)  # nothing keeps them past the weights
            pairs.append((used, super().compute(output, None, mode)))  # runs a forward
            return used

    class BothSources(OBLRPOTrainer):
        weights_class = BothSourcesWeights

    trainer = make_trainer(trainer_cls=BothSources, max_steps=2, temperature=0.8)
    trainer.train()
    assert len(pairs) == 2
    for from_generation, from_forward in pairs:
        assert torch.allclose(from_generation, from_forward, rtol=1e-4, atol=1e-6)


class LossGradientRecorder:
    """Mixin recording ∂loss/∂(per-token log-probs), the per-token factors of the real TRL loss (per_sample SNR path)."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        self._inputs_of_loss = inputs
        try:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        finally:
            self._inputs_of_loss = None

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        measure = self.completion_weights.grad_sq_norms

        def recording(batch, token_scale):
            if getattr(self, "_inputs_of_loss", None) is batch:
                self.loss_token_grads.append((token_scale.detach().clone(), batch["advantages"].clone(),
                                              batch["completion_mask"].clone()))
            return measure(batch, token_scale)

        self.completion_weights.grad_sq_norms = recording


@pytest.mark.parametrize("loss_type", ["grpo", "sapo", "bnpo", "dr_grpo", "dapo", "cispo"])
def test_weights_follow_how_the_loss_scales_each_completion(make_trainer, loss_type):
    """The weight is the squared norm of completion i's contribution to the loss gradient without A_i: the real loss's
    per-token factors ∂loss/∂log p_it, divided by A_i, must be the gains the weights use (1/L_i for a per-completion
    token mean, else a constant), up to one constant for the batch (SAPO's soft gate has one per sign of A_i)."""
    from oblr_trl import OBLRPOTrainer
    from oblr_trl.estimators.weights import loss_token_gains

    class Recorder(LossGradientRecorder, OBLRPOTrainer):
        loss_token_grads = []

    Recorder.loss_token_grads = []
    trainer = make_trainer(trainer_cls=Recorder, loss_type=loss_type, snr_estimator="per_sample", max_steps=1)
    trainer.train()
    assert Recorder.loss_token_grads
    for grads, advantages, mask in Recorder.loss_token_grads:
        gains = loss_token_gains(mask, loss_type)
        rows = advantages.abs() > 1e-6
        per_token = grads / (advantages[:, None] * gains)  # one constant per row if the gains are right
        values = per_token[rows][mask[rows].bool()]
        for sign in (advantages[rows] > 0).unique():
            same_sign = (advantages[rows] > 0) == sign
            constants = per_token[rows][same_sign][mask[rows][same_sign].bool()]
            assert torch.allclose(constants, constants[0].expand_as(constants), rtol=1e-4), (loss_type, constants)
        if loss_type != "sapo":
            assert torch.allclose(values, values[0].expand_as(values), rtol=1e-4), (loss_type, values)
    lengths = mask.sum(-1)
    if loss_type in ("grpo", "sapo") and lengths.unique().numel() > 1:  # the test can see a wrong gain
        assert not torch.allclose(gains, torch.ones_like(gains))


def test_exact_weights_are_measured_only_where_rewards_differ(make_trainer):
    """Prompts "a+b=" with b even score 0.5 for every completion (the others their length): their groups' exact weights cannot change an
    advantage, so the ghost-norm pass skips them (NaN weights, `oblr/weights/measured_frac`), and the weights it does
    measure are those of a pass over every completion (that the advantages then agree: `test_baselines.py`)."""
    from oblr_trl import OBLRPOTrainer
    from oblr_trl.training.completion_weights import CompletionWeights

    def alike_for_even_b(prompts, completions, **kwargs):
        return [0.5 if int(p[2]) % 2 == 0 else len(c) / 10 for p, c in zip(prompts, completions)]

    measured_rows, batches = [], []

    class Recording(CompletionWeights):
        def grad_sq_norms(self, batch, token_scale):
            measured_rows.append(batch["completion_ids"].size(0))
            return super().grad_sq_norms(batch, token_scale)

        def compute(self, output, record, mode, measure=None):
            used = super().compute(output, record, mode, measure)
            batches.append((used, super().compute(output, record, mode), measure))
            return used

    class Trainer(OBLRPOTrainer):
        weights_class = Recording

    trainer = make_trainer(trainer_cls=Trainer, reward_funcs=alike_for_even_b, baseline_weights="exact",
                           baseline_estimator="weighted", max_steps=2, shuffle_dataset=False)
    trainer.train()
    assert len(batches) == 2
    for used, every, measure in batches:
        assert measure.tolist() == [False] * 4 + [True] * 4  # prompts 0+0= (alike), 0+1=; then 0+2=, 0+3=
        # the same rows, passed with or without the others (chunks of other shapes): equal to float32 rounding
        assert torch.allclose(used[measure], every[measure], rtol=1e-5) and used[~measure].isnan().all()
    # per generation batch: 4 measured rows (its spread group), then all 8 (the comparison above)
    assert measured_rows == [4, 8, 4, 8]
    fractions = [log["oblr/weights/measured_frac"] for log in trainer.state.log_history if "loss" in log]
    assert fractions == [0.5, 0.5]


def test_exact_weights_run_under_the_mixed_precision_of_training(make_trainer):
    """accelerate runs the model's own forward under autocast (bf16 here); the ghost-norm pass calls the backbone
    directly, so the trainer enters the same autocast for it: the layers compute as in training."""
    from oblr_trl import OBLRPOTrainer
    from oblr_trl.training.completion_weights import CompletionWeights

    seen = []

    class Spying(CompletionWeights):
        def grad_sq_norms(self, batch, token_scale):
            layer = self.policy.model.layers[0].mlp.down_proj
            handle = layer.register_forward_hook(lambda *_: seen.append(torch.is_autocast_enabled("cpu")))
            try:
                return super().grad_sq_norms(batch, token_scale)
            finally:
                handle.remove()

    class Trainer(OBLRPOTrainer):
        weights_class = Spying

    trainer = make_trainer(trainer_cls=Trainer, baseline_weights="exact", bf16=True, use_cpu=True, max_steps=1)
    assert next(trainer.model.parameters()).dtype == torch.float32
    trainer.train()
    assert seen and all(seen)


def test_exact_weights_keep_non_reentrant_gradient_checkpointing(make_trainer):
    """Under non-reentrant checkpointing (transformers' and TRL's default) the ghost-norm pass keeps the layers
    checkpointed, so that it holds one layer's activations at a time as training does: each decoder layer runs twice
    in the pass (the forward and the backward's recompute). Reentrant checkpointing cannot be differentiated with
    `torch.autograd.grad`: the pass switches it off (each layer once). The weights are the same either way."""
    from oblr_trl import OBLRPOTrainer
    from oblr_trl.training.completion_weights import CompletionWeights

    def run(reentrant):
        calls, norms = [], []

        class Counting(CompletionWeights):
            def grad_sq_norms(self, batch, token_scale):
                handle = self.policy.model.layers[0].mlp.register_forward_pre_hook(lambda *_: calls.append(1))
                try:
                    norms.append(super().grad_sq_norms(batch, token_scale))
                finally:
                    handle.remove()
                return norms[-1]

        class Trainer(OBLRPOTrainer):
            weights_class = Counting

        trainer = make_trainer(trainer_cls=Trainer, baseline_weights="exact", gradient_checkpointing=True,
                               gradient_checkpointing_kwargs={"use_reentrant": reentrant}, max_steps=1)
        trainer.train()
        assert norms and len(calls) == len(norms) * (1 if reentrant else 2)
        assert bool(trainer.completion_weights.recomputed_layers()) is not reentrant
        return norms[0]

    kept, switched_off = run(reentrant=False), run(reentrant=True)
    assert torch.allclose(kept, switched_off, rtol=1e-5)
