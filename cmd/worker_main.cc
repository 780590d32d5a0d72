// ltrain-worker: one training rank. Everything lives in the worker library; see worker/run_worker.h.
#include "worker/run_worker.h"

int main(int argc, char** argv) { return ltrain::worker::RunWorker(argc, argv); }
