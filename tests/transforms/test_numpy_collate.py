"""collate_numpy / collate_vl_numpy (numpy batches, for MindSpore and other non-PyTorch loops) pad exactly as
the torch collates do: the torch ones are built on them."""

import numpy as np
import pytest
import torch

from resumable_stream.transforms import collate, collate_numpy, collate_vl, collate_vl_numpy

TEXT = [{"input_ids": [5, 6, 7], "labels": [-100, 6, 7]}, {"input_ids": [8], "labels": [8]}]
NEAT = [{"input_ids": [5, 6, 7], "labels": [-100, 6, 7], "position_ids": [0, 1, 0]},
        {"input_ids": [8], "labels": [-100], "position_ids": [0]}]


def test_text_batches_are_int64_arrays_padded_like_collate():
    arrays = collate_numpy(TEXT, pad_token_id=0)
    assert {k: v.dtype for k, v in arrays.items()} == dict.fromkeys(["input_ids", "labels", "attention_mask"],
                                                                      np.dtype(np.int64))
    assert arrays["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0]]
    assert arrays["labels"].tolist() == [[-100, 6, 7], [8, -100, -100]]
    assert arrays["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    tensors = collate(TEXT, pad_token_id=0)
    assert {k: v.tolist() for k, v in tensors.items()} == {k: v.tolist() for k, v in arrays.items()}
    assert all(t.dtype == torch.int64 for t in tensors.values())


def test_neat_packing_gives_position_ids_with_their_own_tail_segment():
    arrays = collate_numpy(NEAT, pad_token_id=0)
    assert arrays["position_ids"].tolist() == [[0, 1, 0], [0, 0, 1]]
    tensors = collate(NEAT, pad_token_id=0, flash_attn_kwargs=True)
    assert tensors["position_ids"].tolist() == arrays["position_ids"].tolist()
    assert "attention_mask" not in tensors and tensors["use_cache"] is False
    assert tensors["cu_seq_lens_q"].tolist() == [0, 2, 3, 4, 6]


def test_vl_batches_pad_token_fields_and_concatenate_image_fields():
    examples = [{"input_ids": np.array([1, 2, 3]), "labels": np.array([-100, 2, 3]),
                 "token": {"mm_token_type_ids": np.array([0, 1, 0])},
                 "vision": {"pixel_values": np.ones((4, 2), np.float32), "image_grid_thw": np.array([[1, 2, 2]])}},
                {"input_ids": np.array([4]), "labels": np.array([4]), "token": {"mm_token_type_ids": np.array([0])},
                 "vision": {"pixel_values": np.zeros((2, 2), np.float32), "image_grid_thw": np.array([[1, 1, 2]])}}]
    arrays = collate_vl_numpy(examples, pad_token_id=0)
    assert arrays["mm_token_type_ids"].tolist() == [[0, 1, 0], [0, 0, 0]]
    assert arrays["pixel_values"].shape == (6, 2) and arrays["pixel_values"].dtype == np.float32
    assert arrays["image_grid_thw"].tolist() == [[1, 2, 2], [1, 1, 2]]
    tensors = collate_vl(examples, pad_token_id=0)
    assert set(tensors) == set(arrays)
    for name, arr in arrays.items():
        assert isinstance(tensors[name], torch.Tensor) and tensors[name].numpy().tolist() == arr.tolist()


def test_bad_batches_say_what_is_wrong():
    with pytest.raises(ValueError, match="empty batch"):
        collate_numpy([], 0)
    with pytest.raises(ValueError, match="mixed packing modes"):
        collate_numpy([TEXT[0], NEAT[0]], 0)
    with pytest.raises(ValueError, match="pad_token_id is None"):
        collate_numpy(TEXT, None)
