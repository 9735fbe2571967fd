"""Grouping sequences by the prompt tokens they share, and packing them with it laid out once."""
from __future__ import annotations

import torch

from megatron_areal.actor.microbatch import pack
from megatron_areal.actor.shared_prefix import Unit, fit_to_budget, prefix_units

PROMPT = list(range(100, 112))  # 12 tokens


def test_samples_of_a_prompt_share_all_but_its_last_token():
    seqs = [PROMPT + [1, 2, 3], [7] * 5, PROMPT + [1, 2, 9, 9], PROMPT[:6] + [5, 5, 5, 5, 5, 5, 5, 5], PROMPT + [4]]
    masks = [[0] * 11 + [1] * (len(s) - 12) for s in seqs]
    units = prefix_units(seqs, range(5), masks)
    # 0 and 2 also agree on their first two answer tokens, but those are trained: only the prompt
    # (the 11 positions that predict its tokens 1..11) is shared; 3 shares 6 tokens (< MIN_SHARED)
    assert units == [Unit((0, 2, 4), 11), Unit((1,)), Unit((3,))]
    assert prefix_units(seqs, [0, 2]) == [Unit((0, 2), 13)]  # without loss masks: all common tokens but one
    assert prefix_units(seqs, range(5))[0] == Unit((0, 2, 4), 11)  # 4 shares 12 tokens with them
    assert prefix_units(seqs, [4, 2], masks) == [Unit((4, 2), 11)]  # the caller's order


def test_groups_whose_prompts_share_a_header_each_share_their_whole_prompt():
    # a chat template starts every prompt with the same system header; grouping all samples by the
    # header alone would recompute the rest of each prompt for every sample
    header = list(range(500, 520))  # 20 tokens
    prompts = [header + [i] * 15 for i in (1, 2, 3)]  # 35 tokens each
    seqs = [p + [900 + j] * (3 + j) for p in prompts for j in range(4)]
    masks = [[0] * 34 + [1] * (len(s) - 35) for s in seqs]
    units = prefix_units(seqs, range(12), masks)
    assert units == [Unit((0, 1, 2, 3), 34), Unit((4, 5, 6, 7), 34), Unit((8, 9, 10, 11), 34)]
    # one group and a sample of another: the group shares its prompt, the other stays whole
    assert prefix_units(seqs, [0, 1, 2, 4], masks) == [Unit((0, 1, 2), 34), Unit((4,))]
    # two samples of different prompts still share their header when that is all there is
    assert prefix_units(seqs, [0, 4], masks) == [Unit((0, 4), 19)]  # the 20 header tokens predict 19 values


def test_deeply_nested_prefixes_need_no_recursion():
    # 1,200 sequences, each sharing one token less with the next: deeper than Python's recursion limit
    seqs = [list(range(1300 - i)) + [5000 + i, 1] for i in range(1200)]
    units = prefix_units(seqs, range(1200))
    assert sum(len(u.members) for u in units) == 1200
    # the best first unit: members 0..650 share range(650) less its last token, saving 650 x 649
    # tokens, the most any run of them can (k members share 1,299 - k)
    assert units[0] == Unit(tuple(range(651)), 649)


def test_pack_gives_each_sequence_its_own_targets_and_positions():
    seqs = [PROMPT + [1, 2, 3], PROMPT + [4], [7, 8, 9]]
    values = {"loss_mask": [[0] * 11 + [1] * 3, [0] * 11 + [1], [0, 1]]}
    mb = pack(seqs, [Unit((0, 1), 11), 2], pad_to_multiple=8, values=values)
    assert mb.tokens.size(1) == 11 + 4 + 2 + 3 + 4  # shared, two branches, the third sequence, padding to 24
    assert mb.n_real_tokens == 20 and mb.continues == (-1, 0, 0, -1, -1)
    for i, idx in zip(mb.seq_ids, mb.value_index):
        assert mb.targets[idx].tolist() == seqs[i][1:]
        assert mb.values["loss_mask"][idx].tolist() == values["loss_mask"][i]
        assert bool(mb.target_mask[idx].all())
        # a position's rotary index is the position of its token in its own sequence
        assert mb.position_ids[0, idx].tolist() == list(range(len(seqs[i]) - 1))
    assert int(mb.target_mask.sum()) == 11 + 3 + 1 + 2  # each shared position is predicted once
    assert mb.max_seqlen == 15


def test_units_over_the_budget_are_cut_into_runs_that_share():
    seqs = [PROMPT + [i] * 10 for i in range(5)]  # 22 tokens each
    lengths = [len(s) for s in seqs]
    units = fit_to_budget([Unit(tuple(range(5)), 11)], lengths, 40)
    assert units == [Unit((0, 1), 11), Unit((2, 3), 11), Unit((4,))]
    assert all(u.n_tokens(lengths) <= 40 for u in units)
    mb = pack(seqs, units)
    assert torch.equal(mb.targets[torch.cat(mb.value_index)], torch.tensor([t for s in seqs for t in s[1:]]))
