"""Independent reference implementations used as test oracles (plain torch, float64, unchunked)."""

import torch


def reference_jsd(student, teacher, mask, beta, temperature):
    """Plain float64 definition: probabilities, the mixture in probability space, mean over mask."""
    student, teacher = student.double(), teacher.double()
    p_s = torch.softmax(student / temperature, dim=-1)
    p_t = torch.softmax(teacher / temperature, dim=-1)

    def kl(p, q):
        return (p * (p.log() - q.log())).sum(-1)

    if beta == 0:
        per_pos = kl(p_t, p_s)
    elif beta == 1:
        per_pos = kl(p_s, p_t)
    else:
        mix = beta * p_t + (1 - beta) * p_s
        per_pos = beta * kl(p_t, mix) + (1 - beta) * kl(p_s, mix)
    return per_pos[mask.bool()].mean()
