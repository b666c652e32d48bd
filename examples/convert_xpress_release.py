"""Convert the xPress authors' training pickle (`refiner_cotrain.pt`) into an xPress folder, or write an xPress
folder in the authors' release format for their vLLM method.

A pickle can run code when it is loaded: the file is read with `torch.load(weights_only=True)` first, which refuses
anything but tensors; the authors' pickles also hold an argparse Namespace, so they load only with --trust-pickle,
which loads the whole pickle. Pass it only for a file from a source you trust.

    # the authors' pickle + the dFlash config it was trained from (a folder, a config.json or a Hub id)
    python examples/convert_xpress_release.py pickle refiner_cotrain.pt --base-config z-lab/Qwen3-8B-DFlash-b16 \
        --out my-xpress --trust-pickle
    # an xPress folder (the release-form head, no draft vocabulary) in the release serving format
    python examples/convert_xpress_release.py release my-xpress --out my-xpress-vllm --num-passes 6

Release serving folders themselves need no conversion: `XPressModel.from_pretrained("UIUC-SSAIL/Qwen3-8B-XPress-b16")`
loads one by path or Hub id.
"""

import argparse
from pathlib import Path

from transformers.utils import cached_file

from modeling_xpress import XPressModel
from modeling_xpress.conversion import convert_release_pickle, write_xpress_release


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    pickle = commands.add_parser("pickle", help="the authors' refiner_cotrain.pt -> an xPress folder")
    pickle.add_argument("path", help="the training pickle")
    pickle.add_argument("--base-config", required=True,
                        help="the dFlash drafter it was trained from: a folder, its config.json, or a Hub repo id")
    pickle.add_argument("--out", required=True, help="folder to save the xPress model to (save_pretrained)")
    pickle.add_argument("--trust-pickle", action="store_true",
                        help="load the whole pickle if it holds more than tensors (it can run code: trusted files only)")
    release = commands.add_parser("release", help="an xPress folder -> the authors' release serving format")
    release.add_argument("path", help="an xPress folder (or Hub id) with the release-form head")
    release.add_argument("--out", required=True, help="the serving folder to write")
    release.add_argument("--num-passes", type=int, help="Jacobi passes the folder asks for (default: the model's K)")
    args = parser.parse_args()

    if args.command == "pickle":
        base = Path(args.base_config)
        if not base.exists():  # a Hub repo id: its config.json, fetched like from_pretrained would
            base = Path(cached_file(args.base_config, "config.json"))
        model = convert_release_pickle(XPressModel, args.path, base, trust_pickle=args.trust_pickle)
        model.save_pretrained(args.out)
    else:
        model = XPressModel.from_pretrained(args.path)
        write_xpress_release(model, args.out, num_passes=args.num_passes)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
