"""The FFT backend: exact linear convolution with the summed kernel by zero padding to >= 2n - 1 per axis."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def fft_size(n: int) -> int:
    """Smallest 2^a 3^b 5^c >= 2n - 1: linear (not circular) convolution of an n-point axis."""
    m = max(1, 2 * int(n) - 1)
    while True:
        k = m
        for p in (2, 3, 5):
            while k % p == 0:
                k //= p
        if k == 1:
            return m
        m += 1


def _prepare_fft(H, W, alpha, mu, sigma, ty, tx):
    """rfft2 of the summed kernel k_h[a, b] = sum_m alpha g_y(a) g_x(b), |a| < H, |b| < W, zero padded."""
    Lh, Lw = fft_size(H), fft_size(W)
    gy, gx = ty * alpha[..., None], tx  # (h, M, 2H-1), (h, M, 2W-1)
    k2 = torch.einsum("hma,hmb->hab", gy, gx)  # offsets a = -(H-1)..H-1, b likewise
    kpad = F.pad(k2, (0, Lw - (2 * W - 1), 0, Lh - (2 * H - 1)))
    kpad = torch.roll(kpad, shifts=(-(H - 1), -(W - 1)), dims=(1, 2))  # offset 0 at index 0, negatives wrap
    return (torch.fft.rfft2(kpad).permute(1, 2, 0)[..., None],)  # (Lh, Lw//2+1, h, 1)


def _apply_fft(v, khat):
    """2-D FFT convolution with the summed kernel.

    Zero padding to L >= 2n - 1 per axis makes the circular convolution equal the Toeplitz one on the
    n x n output window. O(B C L_H L_W log(L_H L_W)), independent of M and sigma.
    """
    B, H, W, h, d = v.shape
    Lh, Lw = fft_size(H), fft_size(W)
    vhat = torch.fft.rfft2(v, s=(Lh, Lw), dim=(1, 2))  # (B, Lh, Lw//2+1, h, d)
    out = torch.fft.irfft2(vhat * khat, s=(Lh, Lw), dim=(1, 2))
    return out[:, :H, :W]
