"""A small conditional flow-matching image model built from diffusers' `UNet2DModel`.

`ImageFlow` predicts the velocity of images (B, C, H, W) in [-1, 1] at time ``t`` in [0, 1],
conditioned on a vector per image (the ``shapes`` task's multi-hot attributes; all zeros is the
unconditional input of classifier-free guidance). The condition goes through a linear layer to
the U-Net's time-embedding width and is added there (the U-Net's ``class_embed_type="identity"``),
and ``t`` is scaled to the U-Net's 0-1000 timestep range.

A convolution cannot tell where it is (it sees the same thing anywhere but at the zero-padded
border), so a model told "on the left" has to learn where the left is from the border alone. With
``coords`` (the default; CoordConv, Liu et al. 2018) two more input channels hold each pixel's
(y, x) in [-1, 1]: measured on the ``shapes`` task (docs/flow.md), 150 steps of pre-training
put the objects in the prompt's half in 0.73 and 0.60 of the images against 0.59 and 0.47
without them (seeds 0 and 1), and Flow-GRPO moves the position further and faster. A model
saved without the key (before the channels existed) loads as it was trained.

`save` / `load` write and read a directory (the U-Net's ``save_pretrained`` files and the
projection), so a run resumes from it and a user can point a config at it.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

__all__ = ["ImageFlow"]


class ImageFlow(nn.Module):
    """Velocity model ``(x (B, C, H, W), t (B,), cond (B, A)) -> (B, C, H, W)``.

    Args:
        cond_dim: width ``A`` of the condition vector.
        image_size: ``H = W``.
        channels: ``C``.
        block_out_channels: the U-Net's widths per resolution (the last level has attention).
        layers_per_block: residual blocks per level.
        coords: give the U-Net each pixel's (y, x) as two more input channels.
    """

    def __init__(
        self,
        cond_dim: int,
        image_size: int = 16,
        channels: int = 3,
        block_out_channels: tuple[int, ...] = (32, 64),
        layers_per_block: int = 1,
        coords: bool = True,
    ) -> None:
        super().__init__()
        from diffusers import UNet2DModel

        self.config = {
            "cond_dim": cond_dim,
            "image_size": image_size,
            "channels": channels,
            "block_out_channels": list(block_out_channels),
            "layers_per_block": layers_per_block,
            "coords": coords,
        }
        levels = len(block_out_channels)
        self.unet = UNet2DModel(
            sample_size=image_size,
            in_channels=channels + (2 if coords else 0),
            out_channels=channels,
            block_out_channels=tuple(block_out_channels),
            layers_per_block=layers_per_block,
            down_block_types=("DownBlock2D",) * (levels - 1) + ("AttnDownBlock2D",),
            up_block_types=("AttnUpBlock2D",) + ("UpBlock2D",) * (levels - 1),
            class_embed_type="identity",
            norm_num_groups=8,
        )
        self.cond_proj = nn.Linear(cond_dim, block_out_channels[0] * 4)
        grid = None
        if coords:  # (2, H, W): each pixel's y, then x; made once, moved with the model, not saved
            ramp = torch.linspace(-1, 1, image_size)
            grid = torch.stack(torch.meshgrid(ramp, ramp, indexing="ij"))
        self.register_buffer("grid", grid, persistent=False)

    def forward(self, x: torch.Tensor, t: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        emb = self.cond_proj(cond.float())
        if self.grid is not None:
            x = torch.cat([x, self.grid.to(x.dtype).expand(x.shape[0], -1, -1, -1)], 1)
        return self.unet(x, t.float() * 1000, class_labels=emb).sample

    def save(self, path: str | Path) -> None:
        """Write ``config.json`` and ``model.safetensors`` into the directory ``path``."""
        from safetensors.torch import save_file

        out = Path(path)
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text(json.dumps({"type": "lmrl-image-flow", **self.config}))
        state = {k: v.detach().contiguous() for k, v in self.state_dict().items()}
        save_file(state, out / "model.safetensors")

    @classmethod
    def load(cls, path: str | Path) -> ImageFlow:
        """The model saved in ``path`` by `save`.

        Raises:
            ModelError: ``path`` holds no image flow model (the message says what is missing).
        """
        from safetensors.torch import load_file

        from lmrl.errors import ModelError

        where = Path(path)
        config_file = where / "config.json"
        if not config_file.is_file() or not (where / "model.safetensors").is_file():
            hint = (
                "; it is a checkpoint of a run: give that run's final/ directory, or resume the "
                "run itself (trainer.resume_mode)"
                if where.name.startswith("global_step_") else ""
            )  # fmt: skip
            raise ModelError(
                f"model.path={where} is not an image flow model (needs config.json and "
                "model.safetensors, written by `lmrl pretrain-flow`, `lmrl demo --task flow` "
                f"or a train-flow run's final/){hint}"
            )
        config = json.loads(config_file.read_text())
        if config.pop("type", None) != "lmrl-image-flow":
            raise ModelError(f"{config_file} is not an lmrl image flow model's config")
        config.setdefault("coords", False)  # saved before the coordinate channels existed
        try:
            model = cls(**config)
            model.load_state_dict(load_file(where / "model.safetensors"))
        except (TypeError, RuntimeError, OSError) as err:
            raise ModelError(f"cannot load the image flow model in {where}: {err}") from None
        return model
