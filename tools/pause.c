/* The sandbox process of the real-node tests' pause image (tools/node-tools.sh builds it static).
 * A pod's sandbox only has to hold the pod's namespaces open, so it sleeps; as PID 1 of the pod it
 * must also reap orphaned children (zombies would otherwise pile up in a shared PID namespace), and
 * it must exit promptly on SIGTERM/SIGINT so that stopping a pod does not wait for SIGKILL.
 * Written for pmem-csi; it is not Kubernetes' pause.c. */
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

static void stop(int sig) { (void)sig; _exit(0); }

static void reap(int sig) {
    (void)sig;
    while (waitpid(-1, NULL, WNOHANG) > 0) {
    }
}

int main(void) {
    struct sigaction on_stop = {.sa_handler = stop};
    struct sigaction on_child = {.sa_handler = reap, .sa_flags = SA_NOCLDSTOP | SA_RESTART};
    if (sigaction(SIGTERM, &on_stop, NULL) || sigaction(SIGINT, &on_stop, NULL) ||
        sigaction(SIGCHLD, &on_child, NULL)) {
        return 1;
    }
    for (;;) {
        pause();
    }
}
