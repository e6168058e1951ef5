"""ImageTokenizer: PIL images <-> grids of VQ codebook indices, around `diffusers.VQModel`.

The embedded model's VQ turns a 64x64 RGB image into 16x16 codes (two 2x downsamplings).  Codes are codebook
*indices* in [0, codebook_size); turning them into unified ids is the UnifiedTokenizer's job
(`image_start + code`).  Pixels go in and come out in [-1, 1] as the VQ was trained.

    vq = ImageTokenizer.from_pretrained("assets/model/vq")
    codes = vq.encode([img])            # LongTensor [1, 16, 16] on vq.device
    [img2] = vq.decode(codes)           # PIL 64x64 RGB
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from diffusers import VQModel
from PIL import Image

from molora.models.families.checkpoint import check_checkpoint, check_finite, read_config
from molora.routing.errors import MoLoRAError

log = logging.getLogger(__name__)


class ImageTokenizerError(MoLoRAError):
    """An image, code grid or VQ directory that the image tokenizer cannot use."""


def vq_config(
    *,
    image_size: int = 64,
    block_out_channels: tuple[int, ...] = (64, 128, 128),
    layers_per_block: int = 1,
    latent_channels: int = 64,
    codebook_size: int = 512,
    norm_num_groups: int = 32,
) -> dict:
    """VQModel kwargs; `len(block_out_channels) - 1` downsamplings (3 blocks: 64x64 -> 16x16)."""
    n = len(block_out_channels)
    return dict(
        in_channels=3, out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * n, up_block_types=("UpDecoderBlock2D",) * n,
        block_out_channels=tuple(block_out_channels), layers_per_block=layers_per_block,
        latent_channels=latent_channels, vq_embed_dim=latent_channels, num_vq_embeddings=codebook_size,
        norm_num_groups=norm_num_groups, sample_size=image_size,
    )


def pil_to_tensor(images: Sequence[Image.Image], size: int) -> torch.Tensor:
    """[B,3,size,size] float in [-1, 1]; converts to RGB and resizes (bicubic) when needed."""
    arrays = []
    for img in images:
        if not isinstance(img, Image.Image):
            raise ImageTokenizerError(f"expected PIL images, got {type(img).__name__}")
        img = img.convert("RGB")
        if img.size != (size, size):
            img = img.resize((size, size), Image.Resampling.BICUBIC)
        arrays.append(np.asarray(img, dtype=np.uint8))
    x = torch.from_numpy(np.stack(arrays)).permute(0, 3, 1, 2).float()
    return x / 127.5 - 1.0


def tensor_to_pil(x: torch.Tensor) -> list[Image.Image]:
    """[B,3,H,W] in [-1, 1] -> PIL RGB images."""
    x = ((x.detach().float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()
    return [Image.fromarray(a, mode="RGB") for a in x]


class ImageTokenizer:
    """A VQModel with encode (images -> codes) and decode (codes -> images). Inference only, no grad."""

    def __init__(self, vq: VQModel) -> None:
        self.vq = vq.eval().requires_grad_(False)
        cfg = vq.config
        self.image_size: int = int(cfg.sample_size)
        factor = 2 ** (len(cfg.block_out_channels) - 1)
        if self.image_size % factor:
            raise ImageTokenizerError(f"image size {self.image_size} is not divisible by the VQ's factor {factor}")
        self.grid: tuple[int, int] = (self.image_size // factor, self.image_size // factor)
        self.codebook_size: int = int(cfg.num_vq_embeddings)
        self.embed_dim: int = int(cfg.vq_embed_dim or cfg.latent_channels)

    @classmethod
    def from_pretrained(cls, vq_dir: str | Path, *, device: torch.device | str = "cpu",
                        dtype: torch.dtype = torch.float32) -> ImageTokenizer:
        vq_dir = Path(vq_dir)
        if not (vq_dir / "config.json").is_file():
            raise ImageTokenizerError(f"{vq_dir} has no config.json: expected a diffusers VQModel directory")
        if not any(vq_dir.glob("*.safetensors")):
            raise ImageTokenizerError(f"{vq_dir} has no .safetensors weights (pickled weights are not loaded)")
        config = read_config(vq_dir / "config.json", ImageTokenizerError)
        # before anything is allocated: the weights fill the VQ the config describes (no size taken on trust)
        check_checkpoint(vq_dir, config, lambda: VQModel.from_config(config), ImageTokenizerError)
        try:
            vq = VQModel.from_pretrained(str(vq_dir), use_safetensors=True, torch_dtype=dtype)
            tokenizer = cls(vq)
        except ImageTokenizerError:
            raise
        except Exception as exc:  # diffusers raises many types on a bad config
            raise ImageTokenizerError(f"cannot load the VQ model from {vq_dir} ({type(exc).__name__}: {exc})") from exc
        check_finite(vq, vq_dir, ImageTokenizerError)
        return tokenizer.to(device=device)

    def save(self, vq_dir: str | Path) -> None:
        self.vq.save_pretrained(str(vq_dir), safe_serialization=True)

    # --- device / dtype ---------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return next(self.vq.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.vq.parameters()).dtype

    def to(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> ImageTokenizer:
        # the codebook lookup (cdist/argmin) stays accurate in bf16/fp16 for our small codebooks
        # (a dtype only when one is asked for: diffusers warns about casts on every .to(dtype=...) call)
        self.vq.to(device=device, **({"dtype": dtype} if dtype is not None else {}))
        return self

    # --- encode / decode --------------------------------------------------------------------
    @torch.inference_mode()
    def encode(self, images: Image.Image | Sequence[Image.Image] | torch.Tensor) -> torch.LongTensor:
        """Codes [B, rows, cols] (long, on self.device) of PIL images or a [B,3,H,W] tensor in [-1, 1]."""
        if isinstance(images, Image.Image):
            images = [images]
        if isinstance(images, torch.Tensor):
            x = images
            if x.dim() == 3:
                x = x.unsqueeze(0)
            if x.dim() != 4 or x.shape[1] != 3 or tuple(x.shape[2:]) != (self.image_size, self.image_size):
                raise ImageTokenizerError(f"expected a tensor [B,3,{self.image_size},{self.image_size}], "
                                          f"got {list(x.shape)}")
        else:
            if len(images) == 0:
                raise ImageTokenizerError("encode needs at least one image")
            x = pil_to_tensor(images, self.image_size)
        x = x.to(device=self.device, dtype=self.dtype)
        h = self.vq.encode(x).latents
        _, _, (_, _, idx) = self.vq.quantize(h)
        return idx.reshape(x.shape[0], *self.grid).long()

    @torch.inference_mode()
    def decode_tensor(self, codes: torch.Tensor) -> torch.Tensor:
        """[B,3,H,W] images in [-1, 1] from codes [B,rows,cols], [rows,cols] or [B, rows*cols]."""
        codes = torch.as_tensor(codes, device=self.device).long()
        rows, cols = self.grid
        if codes.dim() == 2 and tuple(codes.shape) == (rows, cols):
            codes = codes.unsqueeze(0)
        if codes.dim() == 2 and codes.shape[1] == rows * cols:
            codes = codes.reshape(-1, rows, cols)
        if codes.dim() != 3 or tuple(codes.shape[1:]) != (rows, cols):
            raise ImageTokenizerError(f"expected codes [B,{rows},{cols}], got {list(codes.shape)}")
        if codes.numel() and (int(codes.min()) < 0 or int(codes.max()) >= self.codebook_size):
            raise ImageTokenizerError(f"codes must lie in [0, {self.codebook_size}), got "
                                      f"[{int(codes.min())}, {int(codes.max())}]")
        shape = (codes.shape[0], rows, cols, self.embed_dim)
        quant = self.vq.quantize.get_codebook_entry(codes.reshape(-1), shape).to(self.dtype)
        return self.vq.decode(quant, force_not_quantize=True).sample

    def decode(self, codes: torch.Tensor) -> list[Image.Image]:
        """PIL RGB images from codes (see decode_tensor for accepted shapes)."""
        return tensor_to_pil(self.decode_tensor(codes))

    def __repr__(self) -> str:
        return (f"ImageTokenizer({self.image_size}x{self.image_size} -> {self.grid[0]}x{self.grid[1]} codes, "
                f"codebook {self.codebook_size}, {self.device}, {self.dtype})")
