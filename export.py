"""Export models to diffusers pipeline folders that load offline with ``from_pretrained``.

From a training checkpoint (EMA weights; a run folder picks its latest checkpoint):
    python export.py checkpoint runs/NaLaDiT-S-2 exported/nala-dit-s2
    python export.py checkpoint runs/NaLaDiT-S-2/checkpoints/0400000 exported/nala-dit-s2 \\
        --vae sd-vae-ft-ema --copy-vae --labels-file imagenet_classes.txt
From the published DiT / SiT weights (softmax models, official key layout):
    python export.py official DiT-XL-2-256x256.pt exported/dit-xl2-256 --model DiT-XL/2 --image-size 256 \\
        --vae sd-vae-ft-ema --copy-vae
    python export.py official SiT-XL-2-256.pt exported/sit-xl2-256 --model SiT-XL/2 --model-only
Then:
    python -c "import nala_dit.pipelines.pipeline as p; print(p.load_pipeline('exported/nala-dit-s2')([1]).images)"
    python sample.py --ckpt exported/nala-dit-s2 --labels 1,2 --grid grid.png
    python -c "import nala_dit, diffusers; nala_dit.register_with_diffusers(); print(diffusers.DiffusionPipeline.from_pretrained('exported/nala-dit-s2'))"

Without --copy-vae the pipeline stores only the VAE's path or hub id (``vae_path``) and
loads it on first use; with it the VAE is saved inside the folder.

Every folder carries a model card, ``README.md`` (metadata for the Hub; the preset, parameter
count, attention, the training recipe and what the run measured, its last sample grid as
``sample_grid.png``, and the lines that sample it; nala_dit/pipelines/card.py). The last line
printed is huggingface_hub's own command that publishes the folder (after ``hf auth login``):
    hf upload USER/REPO exported/nala-dit-s2
"""

import argparse
import sys

from nala_dit.cli.requirements import require_installed

require_installed()  # a python without torch (not the .venv one): one line naming .venv, not a traceback

from nala_dit.cli.parse import ArgumentParser, Interrupted, passive_wait_policy, run_main

passive_wait_policy()  # OMP_WAIT_POLICY=PASSIVE before torch loads, unless set (docs/performance.md, Threads)


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    ck = sub.add_parser("checkpoint", help="a training checkpoint → pipeline folder")
    ck.add_argument("ckpt", help="checkpoint folder or run folder")
    ck.add_argument("out_dir")
    ck.add_argument("--weights", choices=["ema", "model"], default="ema")

    off = sub.add_parser("official", help="a published DiT/SiT .pt → pipeline (or model) folder")
    off.add_argument("pt", help="e.g. DiT-XL-2-256x256.pt or SiT-XL-2-256.pt")
    off.add_argument("out_dir")
    off.add_argument("--model", required=True, help="softmax preset, e.g. DiT-XL/2 or SiT-XL/2")
    off.add_argument("--image-size", type=int, default=256, help="pixels (the latent side is a 1/8 of it)")
    off.add_argument("--num-classes", type=int, default=1000)
    off.add_argument("--model-only", action="store_true", help="save only the transformer (DiT.from_pretrained)")

    for sp in (ck, off):
        sp.add_argument("--vae", help="VAE folder or hub id (checkpoint: default the one it trained with)")
        sp.add_argument("--copy-vae", action="store_true", help="save the VAE inside the folder (else a reference)")
        sp.add_argument("--labels-file", help="class names: .json (list or {id: name}) or one name per line")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return run(args)
    except (ValueError, FileNotFoundError, OSError, RuntimeError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        raise Interrupted(f"nothing was written to {args.out_dir} (an export is renamed into place when complete); "
                          f"run the same command again")


def run(args) -> int:
    from nala_dit.pipelines.export import check_out_dir
    from nala_dit.pipelines.sources import read_labels_file

    check_out_dir(args.out_dir)  # before any loading: an existing export or other files are never touched
    id2label = read_labels_file(args.labels_file) if args.labels_file else None
    if args.command == "checkpoint":
        from nala_dit.pipelines.export import write_folder
        from nala_dit.pipelines.pipeline import pipeline_from_checkpoint

        pipe = pipeline_from_checkpoint(args.ckpt, args.weights, args.vae, args.copy_vae, id2label)
    else:
        from nala_dit.models.vae import load_vae
        from nala_dit.pipelines.export import write_folder
        from nala_dit.pipelines.pipeline import pipeline_for
        from nala_dit.pipelines.sources import OFFICIAL_VAE, load_official_state_dict, model_from_official

        if args.copy_vae and not args.vae:
            raise ValueError("--copy-vae needs --vae PATH (the VAE folder to copy)")
        model = model_from_official(load_official_state_dict(args.pt), args.model, args.image_size, args.num_classes)
        if args.model_only:
            from nala_dit.pipelines.card import model_card

            source = dict(model=args.model, checkpoint=str(args.pt), weights="official")
            vae = args.vae or OFFICIAL_VAE   # what its card's lines load it with
            write_folder(model, args.out_dir, card=model_card(model, args.out_dir, source, vae))
            print(f"wrote model folder {args.out_dir} (nala_dit.DiT.from_pretrained), model card README.md")
            print(publish_line(args.out_dir))
            return 0
        vae, scaling = (load_vae(args.vae) if args.vae else (None, None))
        vae_path = args.vae or OFFICIAL_VAE  # what DiT and SiT were trained with
        pipe = pipeline_for(model, vae=vae if args.copy_vae else None, id2label=id2label, scaling_factor=scaling,
                            vae_path=None if args.copy_vae else vae_path,
                            source=dict(model=args.model, checkpoint=str(args.pt), weights="official"))
    write_folder(pipe, args.out_dir)
    norm = f", latents normalised {pipe.latent_norm.describe()}" if pipe.config.latent_norm else ""
    print(f"wrote {type(pipe).__name__} folder {args.out_dir}{norm}, model card README.md")
    print(publish_line(args.out_dir))
    return 0


def publish_line(out_dir: str) -> str:
    """huggingface_hub's command that publishes ``out_dir`` (the ``hf`` beside this python
    when there is one, as ``make`` installs it), and how the folder loads back."""
    import shlex
    from pathlib import Path

    hf = Path(sys.executable).parent / "hf"
    shown = "hf"
    if hf.is_file():
        try:
            shown = str(hf.relative_to(Path.cwd()))
        except ValueError:
            shown = str(hf)
    return (f"publish: {shown} upload USER/REPO {shlex.quote(str(out_dir))}    # after `hf auth login`; it loads "
            f"back with DiffusionPipeline.from_pretrained(\"USER/REPO\") after nala_dit.register_with_diffusers()")


if __name__ == "__main__":
    sys.exit(run_main(main))
