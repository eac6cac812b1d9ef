"""BBP-MAP by hand (alignfl/core/merging/bbp.py): two clients of two small units each, at the default sigma and at a
sigma of their own scale, against the authors' scores worked out with plain numbers."""

from __future__ import annotations

import math

import torch

from alignfl.core.merging.bbp import BBPSettings, extended_cost, match_units

# --- a hand-worked example at a second weight scale -----------------------------------------------
#
# Two clients with two small units each (weights of about 0.1, where the other BBP-MAP tests use a standard
# deviation of 2): client 0 has a1 = (0.1, -0.2), a2 = (0.0, 0.1); client 1 has b1 = (0.0, 0.12) ~ a2 and
# b2 = (0.12, -0.2) ~ a1.
# The scores below are the authors' formulas (module notes of alignfl/core/merging/bbp.py) worked out with plain
# numbers:
#   atom i (natural N_i, count c, P = 1/sigma0 + c/sigma):  ||x/sigma + N_i||^2 / (P + 1/sigma) - ||N_i||^2 / P
#                                                           + log(c / (K - c))       (K = 2, c = 1: log 1 = 0)
#   t-th new atom (mu0 = 0):  ||x/sigma||^2 / (1/sigma0 + 1/sigma) + 2 log(gamma / K) - 2 log t


CLIENTS_A = [[0.1, -0.2], [0.0, 0.1]]
CLIENTS_B = [[0.0, 0.12], [0.12, -0.2]]
OPEN = 2 * math.log(7 / 2)  # 2 log(gamma / K) = 2.5055 with gamma = 7, K = 2
SECOND = 2 * math.log(2)  # the second new atom's extra 2 log t = 1.3863


def _assert_hand_worked(
    settings: BBPSettings, cost: list[list[float]], assignments: list[list[int]], units: list[list[float]]
) -> None:
    """Client 1's scores against the atoms client 0 opened (client 0 is as wide and comes first) are ``cost``,
    and BBP-MAP gives ``assignments`` and posterior ``units`` in every sweep order."""
    rows = [torch.tensor(CLIENTS_A, dtype=torch.float64), torch.tensor(CLIENTS_B, dtype=torch.float64)]
    first_pass = extended_cost(rows[1], rows[0] / settings.sigma, torch.ones(2, dtype=torch.float64), 2, settings, 2)
    torch.testing.assert_close(first_pass, torch.tensor(cost, dtype=torch.float64), rtol=1e-9, atol=1e-12)
    for seed in range(4):
        match = match_units(rows, [1.0, 1.0], settings, generator=seed)
        assert [a.tolist() for a in match.assignments] == assignments
        torch.testing.assert_close(match.units, torch.tensor(units, dtype=torch.float64), rtol=0, atol=1e-12)


def test_hand_worked_small_weights_open_new_atoms_at_the_default_scale():
    """sigma = sigma0 = 1: the new-atom bonus 2 log(7/2) = 2.51 dwarfs every match score (about 0.01 for weights
    of 0.1), so every unit opens its own atom, even b1 next to a2 (the authors' code does the same)."""
    expected = [  # rows b1, b2; columns a1, a2, new atom t = 1, t = 2; P = 1 + 1 = 2, P + 1 = 3
        [
            (0.1**2 + 0.08**2) / 3 - (0.1**2 + 0.2**2) / 2,  # b1 + a1 = (0.1, -0.08): -0.0195
            (0.0**2 + 0.22**2) / 3 - (0.0**2 + 0.1**2) / 2,  # b1 + a2 = (0.0, 0.22):  0.0111
            (0.0**2 + 0.12**2) / 2 + OPEN,  # 2.5127
            (0.0**2 + 0.12**2) / 2 + OPEN - SECOND,
        ],  # 1.1264
        [
            (0.22**2 + 0.4**2) / 3 - (0.1**2 + 0.2**2) / 2,  # b2 + a1 = (0.22, -0.4): 0.0445
            (0.12**2 + 0.1**2) / 3 - (0.0**2 + 0.1**2) / 2,  # b2 + a2 = (0.12, -0.1): 0.0031
            (0.12**2 + 0.2**2) / 2 + OPEN,  # 2.5327
            (0.12**2 + 0.2**2) / 2 + OPEN - SECOND,
        ],  # 1.1464
    ]
    # Best assignment: both new atoms, 2.5127 + 1.1464 = 1.1264 + 2.5327 = 3.6592, against at most
    # 2.5327 + 0.0111 = 2.5438 with one match. A sweep takes a client out (its atoms go) and puts it back: the
    # same scores with the clients' roles swapped, so nothing changes.
    # Posterior mean of a one-member atom: (mu0/sigma0 + x/sigma) / (1/sigma0 + 1/sigma) = x / 2.
    _assert_hand_worked(
        BBPSettings(), expected, [[0, 1], [2, 3]], [[0.05, -0.1], [0.0, 0.05], [0.0, 0.06], [0.06, -0.1]]
    )


def test_hand_worked_small_weights_match_at_their_own_scale():
    """sigma = sigma0 = 0.01 (variances of weights of about 0.1): x/sigma is 100 x, so the match scores are in
    the units of the new-atom bonus again; b2 joins a1's atom and b1 still opens its own."""
    expected = [  # rows b1 = (0, 12), b2 = (12, -20) scaled; atoms a1 = (10, -20), a2 = (0, 10); P = 200, P + 100 = 300
        [
            (10**2 + 8**2) / 300 - (10**2 + 20**2) / 200,  # b1 + a1 = (10, -8):   0.5467 - 2.5 = -1.9533
            (0**2 + 22**2) / 300 - (0**2 + 10**2) / 200,  # b1 + a2 = (0, 22):    1.6133 - 0.5 = 1.1133
            (0**2 + 12**2) / 200 + OPEN,  # 0.72 + 2.5055 = 3.2255
            (0**2 + 12**2) / 200 + OPEN - SECOND,
        ],  # 1.8392
        [
            (22**2 + 40**2) / 300 - (10**2 + 20**2) / 200,  # b2 + a1 = (22, -40):  6.9467 - 2.5 = 4.4467
            (12**2 + 10**2) / 300 - (0**2 + 10**2) / 200,  # b2 + a2 = (12, -10):  0.8133 - 0.5 = 0.3133
            (12**2 + 20**2) / 200 + OPEN,  # 2.72 + 2.5055 = 5.2255
            (12**2 + 20**2) / 200 + OPEN - SECOND,
        ],  # 3.8392
    ]
    # Best: b1 new (3.2255) + b2 on a1 (4.4467) = 7.6721; both new 3.2255 + 3.8392 = 7.0647; b1 on a2 and b2 on
    # a1 = 5.5600; b1 on a2 and b2 new = 6.3389. Atoms: {a1, b2}, {a2}, {b1}.
    # Sweep, client 1 out: back to client 0's atoms, and the same scores put it back the same way.
    # Sweep, client 0 out: atoms {b2} (natural (12, -20)) and {b1} ((0, 12)), each one member; client 0 scores
    #   a1 = (10, -20) on {b2}: (22**2 + 40**2) / 300 - (12**2 + 20**2) / 200 = 4.2267,
    #                  on {b1}: (10**2 + 8**2) / 300 - (0**2 + 12**2) / 200 = -0.1733,
    #                  new: (10**2 + 20**2) / 200 + OPEN = 5.0055 (t = 2: 3.6192);
    #   a2 = (0, 10)   on {b2}: (12**2 + 10**2) / 300 - (12**2 + 20**2) / 200 = -1.9067,
    #                  on {b1}: (0**2 + 22**2) / 300 - (0**2 + 12**2) / 200 = 0.8933,
    #                  new: (0**2 + 10**2) / 200 + OPEN = 3.0055 (t = 2: 1.6192);
    #   best: a1 on {b2} and a2 new, 4.2267 + 3.0055 = 7.2322 (both new: 6.6247): the same atoms, so the
    #   sweep changes nothing, in either order, and matching stops.
    # Posterior means, natural / precision: {a1, b2}: (10 + 12, -20 - 20) / (100 + 2 * 100);
    # {a2}: (0, 10) / 200; {b1}: (0, 12) / 200.
    _assert_hand_worked(
        BBPSettings(sigma=0.01, sigma0=0.01),
        expected,
        [[0, 1], [2, 0]],
        [[22 / 300, -40 / 300], [0.0, 10 / 200], [0.0, 12 / 200]],
    )
