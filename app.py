"""Start the MoLoRA demo: `python app.py` (the embedded model, CPU or GPU, queue on).

    python app.py                         # assets/model + assets/adapters, http://127.0.0.1:7860
    python app.py --model /path/to/dir    # another model directory (also: MOLORA_MODEL=/path/to/dir)
    GRADIO_SERVER_NAME=0.0.0.0 GRADIO_SERVER_PORT=8080 python app.py

This is also the Hugging Face Space's app_file. The code lives in app/ (app/server.py: loading and launching).
"""

from molora.app.server import main

if __name__ == "__main__":
    main()
