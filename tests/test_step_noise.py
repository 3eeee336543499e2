"""StepNoiseRecorder, the SNR bookkeeping the trainer delegates to (its numbers are checked end to end in
test_trainer.py, test_multiprocess.py and test_fsdp2.py)."""

from collections import defaultdict

import pytest
import torch

from oblr_trl.training.step_noise import StepNoiseRecorder


def _recorder(sharded: bool, gradients_in_grad: bool = True) -> tuple[StepNoiseRecorder, torch.nn.Linear]:
    with torch.random.fork_rng():
        torch.manual_seed(0)
        layer = torch.nn.Linear(3, 2)
    recorder = StepNoiseRecorder(list(layer.parameters()), "cross_step", 2, sharded=sharded,
                                 gradients_in_grad=gradients_in_grad)
    return recorder, layer


def _finish(recorder: StepNoiseRecorder) -> None:
    recorder.finish_step(1.0, lambda stats: stats, torch.device("cpu"), 1, 1.0, defaultdict(list))


def test_sharded_mode_refuses_a_step_whose_shards_were_never_read():
    """If the Trainer stops calling the points where the shards are read (another transformers version), the step
    must fail loudly rather than pair an empty sketch."""
    recorder, _ = _recorder(sharded=True)
    assert recorder.hooks is None
    recorder.new_generation()
    recorder.start_backward(4)
    with pytest.raises(RuntimeError, match="did not read this step's gradient before clipping"):
        _finish(recorder)


@pytest.mark.parametrize("gradients_in_grad", [True, False], ids=["step-end", "hooks"])
def test_steps_pair_only_when_their_generation_batches_are_disjoint(gradients_in_grad):
    recorder, layer = _recorder(sharded=False, gradients_in_grad=gradients_in_grad)
    assert (recorder.hooks is None) == gradients_in_grad
    metrics = defaultdict(list)
    for generation in (1, 1, 2):  # the second step reuses the first step's generation batch
        if generation != recorder.generation:
            recorder.new_generation()
        layer.zero_grad()
        recorder.start_backward(4)
        layer(torch.randn(4, 3)).sum().backward()
        recorder.end_backward()
        recorder.read_step_gradients(layer.parameters())
        recorder.finish_step(1.0, lambda stats: stats, torch.device("cpu"), 1, 1.0, metrics)
    assert len(metrics["snr/grad_sq_norm"]) == 1  # only steps 2 → 3 drew from disjoint generation batches


def test_the_step_end_sketch_equals_the_sum_of_the_micro_batch_sketches():
    """Read once from the accumulated .grad or hooked on every micro-batch: the same sketch (it is linear)."""
    sketches = []
    for gradients_in_grad in (True, False):
        recorder, layer = _recorder(sharded=False, gradients_in_grad=gradients_in_grad)
        generator = torch.Generator().manual_seed(0)
        for _ in range(3):  # micro-batches accumulating into .grad
            recorder.start_backward(2)
            layer(torch.randn(2, 3, generator=generator)).square().sum().backward()
            recorder.end_backward()
        recorder.read_step_gradients(layer.parameters())
        sketches.append(recorder.sketch.pop(torch.device("cpu")))
    torch.testing.assert_close(sketches[0], sketches[1])
