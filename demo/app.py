"""The SpecLA Gradio demo: ``python demo/app.py [--target ...] [--drafter ...] [--port 7860]``.

The same as ``specla demo``, whose options it takes; the app itself is ``specla_hf.app.demo`` so that an installed
package has it too.
"""
import sys

from specla_hf.app.cli import main

if __name__ == "__main__":
    sys.exit(main(["demo", *sys.argv[1:]]))
