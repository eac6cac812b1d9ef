"""Client-side pieces that need no simulation: node identity, PAN agreement, what a model sends."""

from types import SimpleNamespace

import pytest
import torch
from flwr.app import ConfigRecord

from alignfl.core.config import RunConfig
from alignfl.core.data import load_dataset
from alignfl.core.model_io import build_run_model, load_arrays, to_arrays
from alignfl.fl_app.client_app import check_pan_agreement, client_data, node_partition
from alignfl.fl_app.config import parse_run_config


def test_node_partition_is_read_and_checked():
    assert node_partition(SimpleNamespace(node_config={"partition-id": 2, "num-partitions": 5})) == (2, 5)
    with pytest.raises(ValueError, match="--node-config"):
        node_partition(SimpleNamespace(node_config={}))
    with pytest.raises(ValueError, match=r"partition-id=5 must lie in \[0, num-partitions=5\)"):
        node_partition(SimpleNamespace(node_config={"partition-id": 5, "num-partitions": 5}))


def test_client_with_other_pan_settings_is_refused():
    mine = RunConfig(pan_mode="mul", pan_t=1.0, pan_a=0.1)
    check_pan_agreement(mine, ConfigRecord(mine.pan_signature()))
    with pytest.raises(ValueError, match="PAN settings differ.*pan-a"):
        check_pan_agreement(mine, ConfigRecord({**mine.pan_signature(), "pan-a": 0.2}))


def test_pan_encodings_never_travel_and_survive_loading():
    config = parse_run_config({"dataset": "digits", "model": "vgg9", "pan-mode": "mul", "pan-t": 4.0, "pan-a": 0.5})
    dataset = load_dataset("digits")
    model = build_run_model(config, dataset)
    encodings = {name: buf.clone() for name, buf in model.named_buffers() if name.endswith("encoding")}
    assert encodings and not set(encodings) & set(to_arrays(model))
    other = build_run_model(config, dataset)
    for param in other.parameters():
        torch.nn.init.normal_(param)
    load_arrays(model, to_arrays(other))
    for name, buf in model.named_buffers():
        if name in encodings:
            assert torch.equal(buf, encodings[name])


def test_client_data_splits_its_partition_80_20():
    config = RunConfig(dataset="digits", partitioner="iid")
    data = client_data(config, partition_id=1, num_partitions=4)
    assert len(data.train_y) + len(data.test_y) in (359, 360)  # 1437 training images / 4
    assert abs(len(data.test_y) / (len(data.train_y) + len(data.test_y)) - 0.2) < 0.01
