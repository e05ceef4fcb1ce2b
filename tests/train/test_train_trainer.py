import torch
from tqdm import tqdm

from pagedmoe.train.trainer import CHECKPOINT, Trainer, read_metrics, train


def train_losses(run_dir) -> list[float]:
    return [m["loss"] for m in read_metrics(run_dir) if m["kind"] == "train"]


def test_loss_falls_on_a_small_slice(tiny_config):
    cfg = tiny_config(router="top2", max_steps=150, lr=1e-2, warmup_steps=10)
    run_dir = train(cfg)
    losses = train_losses(run_dir)
    assert len(losses) == 150
    assert sum(losses[-5:]) / 5 < losses[0] - 1.2
    final_eval = [m for m in read_metrics(run_dir) if m["kind"] == "eval"][-1]
    assert final_eval["val_loss"] < losses[0] - 1.0
    assert len(final_eval["val_cv"]) == cfg.num_layers


def test_metrics_record_per_layer_balance_and_drops(tiny_config):
    run_dir = train(tiny_config(router="switch", max_steps=3))
    record = read_metrics(run_dir)[0]
    assert record["kind"] == "train" and len(record["cv"]) == 2 and 0.0 <= record["dropped"] < 1.0
    assert record["tokens_per_s"] > 0


def test_resume_continues_exactly_where_it_stopped(tiny_config, tmp_path):
    straight = Trainer(tiny_config(router="noisy_topk", max_steps=8, out_dir=str(tmp_path / "straight")))
    straight.run()
    interrupted = Trainer(tiny_config(router="noisy_topk", max_steps=8, out_dir=str(tmp_path / "resumed")))
    for _ in range(4):
        interrupted.one_step(tqdm(disable=True))
    interrupted.save()
    resumed = Trainer(tiny_config(router="noisy_topk", max_steps=8, out_dir=str(tmp_path / "resumed")))
    assert resumed.state.step == 4
    resumed.run()
    assert train_losses(tmp_path / "resumed") == train_losses(tmp_path / "straight")
    for key, value in straight.model.state_dict().items():
        assert torch.equal(value, resumed.model.state_dict()[key]), key
    assert (tmp_path / "resumed" / CHECKPOINT).exists()


def test_sigmoid_bias_training_updates_bias_buffer(tiny_config):
    trainer = Trainer(tiny_config(router="sigmoid_bias", max_steps=5, bias_update_speed=1e-2))
    trainer.run()
    biases = [router.e_score_correction_bias for router in trainer.routers]
    assert all(bias.abs().sum() > 0 for bias in biases)
    assert all(not bias.requires_grad for bias in biases)
