"""Values coded as the residual of a prediction from their own token's dequantized key.

A token's key and value are two projections of one hidden state, so part of the value is a
linear function of the key. The ``prerope`` method stores ``Q(v - P(k~_hat))`` instead of
``Q(v)``, with ``P(x) = x @ W + c`` fitted per layer and KV head by least squares on calibration
tokens, and reads ``v_hat = P(k~_hat) + Q(v - P(k~_hat))``. ``k~_hat`` is the *dequantized* key in
the code domain (what the codes hold, before the key transform is undone): fitting on exact keys
and predicting from dequantized ones amplifies the key error (docs/results/accuracy.md), and the
code domain is an affine image of the key, so the prediction is the same as from the key itself.
Attention then reads ``sum_j p_j v_hat_j = (sum_j p_j k~_hat_j) @ W + c + sum_j p_j Q(r_j)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

DEFAULT_VALUE_RIDGE = 1e-3  # relative to the mean eigenvalue of the keys' covariance


@dataclass
class ValuePredictor:
    """``matrix: [H_kv, D, D]`` (``W``) and ``bias: [H_kv, D]`` (``c``), float32."""

    matrix: torch.Tensor
    bias: torch.Tensor

    def __post_init__(self) -> None:
        h, d = self.bias.shape
        if tuple(self.matrix.shape) != (h, d, d):
            raise ValueError(f"value predictor matrix {tuple(self.matrix.shape)} does not fit bias {(h, d)}")

    def __call__(self, kt_hat: torch.Tensor) -> torch.Tensor:
        """``kt_hat: [B, H_kv, T, D]`` dequantized keys in the code domain -> predicted values of the
        same shape, float32 (float64 kept)."""
        work = kt_hat.double() if kt_hat.dtype == torch.float64 else kt_hat.float()
        return work @ self.matrix.to(work)[None] + self.bias.to(work)[None, :, None, :]


def fit_value_predictor(
    kt_hat: torch.Tensor, values: torch.Tensor, ridge: float = DEFAULT_VALUE_RIDGE
) -> ValuePredictor:
    """Least squares ``values ~ kt_hat @ W + c`` per KV head from calibration tokens
    (``kt_hat, values: [H_kv, N, D]``), in float64, with a ridge of ``ridge`` times the mean
    eigenvalue of each head's key covariance (keeps ``W`` bounded where the dequantized keys
    leave directions empty)."""
    if kt_hat.shape != values.shape or kt_hat.dim() != 3 or kt_hat.shape[1] < 2:
        raise ValueError(
            f"need keys and values [H_kv, N >= 2, D] of one shape, got {tuple(kt_hat.shape)} and {tuple(values.shape)}"
        )
    if not ridge >= 0:
        raise ValueError(f"ridge must be >= 0, got {ridge}")
    x, y = kt_hat.double(), values.double()
    x_mean, y_mean = x.mean(1, keepdim=True), y.mean(1, keepdim=True)
    xc, yc = x - x_mean, y - y_mean
    cov = xc.transpose(1, 2) @ xc / x.shape[1]
    eye = torch.eye(x.shape[-1], dtype=torch.float64)
    shift = ridge * cov.diagonal(dim1=1, dim2=2).mean(-1).clamp_min(1e-12)[:, None, None] * eye
    matrix = torch.linalg.solve(cov + shift, xc.transpose(1, 2) @ yc / x.shape[1])
    bias = y_mean[:, 0] - (x_mean @ matrix)[:, 0]
    return ValuePredictor(matrix.float(), bias.float())
