/* codedojo sandbox init: the process that sits inside a sandbox's namespaces and starts commands.
 *
 * Why a C helper: spawning bubblewrap (or a Python interpreter) per command costs several
 * milliseconds; this helper enters the namespaces once, at create, and then forks each command
 * on request, so an exec round trip is one fork() and an execve; init alone serves all
 * commands of its sandbox from one poll() loop.
 *
 * Invoked by codedojo/sandbox/local.py (never by users):
 *   codedojo-sandbox-init --root DIR --sock-fd N --uid U --gid G --hostname H
 *                         (--netns-new FILE | --netns-join FILE) [--cgroup PROCSFILE]...
 *                         [--bind SRC:DST]... [--shm-mb N] [--nofile N] [--wait-go 1]
 *
 * With --wait-go (the provider's pool of pre-started sandboxes) init stops after entering the
 * namespaces and cgroups and waits for "G <nofile> <bind>..." on stdin: the filesystem and the
 * limits of the sandbox asked for come later.
 *
 * Each command runs with RLIMIT_NOFILE set to --nofile (soft = hard, 4096 unless given): init
 * itself runs with the host process's limit, raised for a host with many sandboxes, which no
 * command is to have (a few processes holding that many files each take the host's file
 * table).
 *
 * The first process (the "waiter", in the host pid namespace) joins the cgroups, creates or
 * joins the network namespace, unshares mount/pid/ipc/uts and forks pid 1 of the new pid
 * namespace. The waiter prints "P <host pid of init>" on stdout and waits for init; init builds
 * the root (read-only binds of the host's system directories, /proc, a minimal /dev), pivots
 * into DIR, prints "R" (or "E <message>" and exits) and serves requests on the inherited
 * listening unix socket. Killing init (SIGKILL from the host) kills the whole pid namespace.
 *
 * Protocol, one connection per command:
 *   host -> init : u32 length, then NUL-terminated strings: cwd, argc, argv..., envc, env...
 *   init -> host : "F <pid>" with three fds (stdin write end, stdout and stderr read ends)
 *                  attached (SCM_RIGHTS), or "E <message>" on a bad request
 *   host -> init : any byte = kill the command and all it started; EOF = the same
 *   init -> host : "X <wait status>" when the command exits
 *
 * Each command runs under a shepherd, the process init forks (its pid is the one reported): it
 * is the subreaper of everything the command starts, so a kill ends those too, a daemon that
 * left the command's session with setsid() included, which a kill of the process group missed.
 * A command that ends by itself leaves what it started in the background running.
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <linux/audit.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <net/if.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/time.h>
#include <sys/types.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#define MAX_BINDS 32
#define MAX_CGROUPS 8
#define MAX_REQUEST (4 << 20)

static const char *root_dir, *hostname = "sandbox", *netns_file;
static int netns_new, sock_fd = -1, shm_mb = 64, wait_go;
static rlim_t nofile = 4096; /* RLIMIT_NOFILE of every command's processes */
static uid_t owner_uid; /* who started the sandbox: the one user its socket serves */
static uid_t run_uid = 1000;
static gid_t run_gid = 1000;
static const char *binds[MAX_BINDS];
static int n_binds;
static const char *cgroups[MAX_CGROUPS];
static int n_cgroups;

/* The seccomp filter every command runs under. The sandbox user has no capabilities, so most
 * of the kernel's privileged calls fail anyway; these are the ones that do not:
 * - the key management calls: keyrings are per host uid, and every sandbox runs as uid 1000,
 *   so a key one sandbox adds would be visible in every other;
 * - user namespaces (clone/unshare with CLONE_NEWUSER): they hand the process a full set of
 *   capabilities over the kernel's largest attack surface. clone3 passes its flags in memory a
 *   filter cannot read, so it answers ENOSYS and the C library falls back to clone;
 * - bpf, perf_event_open, userfaultfd and io_uring: kernel surface no build or test needs
 *   (io_uring answers ENOSYS, which its users take as "fall back to plain calls");
 * - sockets of any family but unix, IPv4, IPv6 and netlink (EAFNOSUPPORT): the network
 *   namespace confines those four, not the others (AF_VSOCK reaches the hypervisor and the
 *   VM's other users, whatever the namespace).
 * Calls of another ABI (32-bit x86, x32) would bypass the numbers below and are refused. */
#if defined(__x86_64__)
#define SECCOMP_ARCH AUDIT_ARCH_X86_64
#elif defined(__aarch64__)
#define SECCOMP_ARCH AUDIT_ARCH_AARCH64
#else
#error "the sandbox's seccomp filter knows x86_64 and aarch64 only"
#endif
#define SC_NR offsetof(struct seccomp_data, nr)
#define SC_ARG0 offsetof(struct seccomp_data, args[0]) /* low half on little-endian */
#define SC_RET(x) BPF_STMT(BPF_RET | BPF_K, (x))
#define SC_DENY(nr, err) BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, (nr), 0, 1), \
                         SC_RET(SECCOMP_RET_ERRNO | (err))

static int install_seccomp(void) {
  struct sock_filter code[] = {
      BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, arch)),
      BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, SECCOMP_ARCH, 1, 0),
      SC_RET(SECCOMP_RET_ERRNO | ENOSYS),
      BPF_STMT(BPF_LD | BPF_W | BPF_ABS, SC_NR),
#ifdef __x86_64__
      BPF_JUMP(BPF_JMP | BPF_JGE | BPF_K, 0x40000000 /* __X32_SYSCALL_BIT */, 0, 1),
      SC_RET(SECCOMP_RET_ERRNO | ENOSYS),
#endif
      SC_DENY(__NR_add_key, EPERM),
      SC_DENY(__NR_keyctl, EPERM),
      SC_DENY(__NR_request_key, EPERM),
      SC_DENY(__NR_bpf, EPERM),
      SC_DENY(__NR_perf_event_open, EPERM),
      SC_DENY(__NR_userfaultfd, EPERM),
      SC_DENY(__NR_io_uring_setup, ENOSYS),
      SC_DENY(__NR_io_uring_enter, ENOSYS),
      SC_DENY(__NR_io_uring_register, ENOSYS),
      SC_DENY(__NR_clone3, ENOSYS),
      /* socket and socketpair take the address family in the first argument */
      BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, __NR_socket, 1, 0),
      BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, __NR_socketpair, 0, 7),
      BPF_STMT(BPF_LD | BPF_W | BPF_ABS, SC_ARG0),
      BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, AF_UNIX, 3, 0),
      BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, AF_INET, 2, 0),
      BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, AF_INET6, 1, 0),
      BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, AF_NETLINK, 0, 1),
      SC_RET(SECCOMP_RET_ALLOW),
      SC_RET(SECCOMP_RET_ERRNO | EAFNOSUPPORT),
      /* clone and unshare both take their flags in the first argument on these two ABIs */
      BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, __NR_clone, 1, 0),
      BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, __NR_unshare, 0, 3),
      BPF_STMT(BPF_LD | BPF_W | BPF_ABS, SC_ARG0),
      BPF_JUMP(BPF_JMP | BPF_JSET | BPF_K, CLONE_NEWUSER, 0, 1),
      SC_RET(SECCOMP_RET_ERRNO | EPERM),
      SC_RET(SECCOMP_RET_ALLOW),
  };
  struct sock_fprog prog = {sizeof code / sizeof code[0], code};
  return prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &prog);
}

static void die(const char *fmt, ...) {
  char msg[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  dprintf(1, "E %s: %s\n", msg, strerror(errno));
  _exit(1);
}

static void write_file(const char *path, const char *text) {
  int fd = open(path, O_WRONLY | O_CLOEXEC);
  if (fd < 0 || write(fd, text, strlen(text)) < 0) die("write %s", path);
  close(fd);
}

static void lo_up(void) {
  int s = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  struct ifreq ifr;
  if (s < 0) die("socket");
  memset(&ifr, 0, sizeof ifr);
  strcpy(ifr.ifr_name, "lo");
  if (ioctl(s, SIOCGIFFLAGS, &ifr) < 0) die("SIOCGIFFLAGS lo");
  ifr.ifr_flags |= IFF_UP | IFF_RUNNING;
  if (ioctl(s, SIOCSIFFLAGS, &ifr) < 0) die("SIOCSIFFLAGS lo");
  close(s);
}

static void path_in_root(char *out, size_t n, const char *rel) {
  snprintf(out, n, "%s%s", root_dir, rel);
}

static void bind_ro(const char *src, const char *dst) {
  char target[4096];
  path_in_root(target, sizeof target, dst);
  if (mount(src, target, NULL, MS_BIND | MS_REC, NULL) < 0) die("bind %s", src);
  if (mount(NULL, target, NULL, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV, NULL) < 0)
    die("remount ro %s", dst);
}

static int has_dev_nodes(void) {
  char path[4096];
  struct stat st;
  path_in_root(path, sizeof path, "/dev/null");
  return stat(path, &st) == 0 && S_ISCHR(st.st_mode);
}

static void make_dev(void) {
  static const char *nodes[] = {"null", "zero", "full", "random", "urandom", "tty"};
  char path[4096], src[64];
  path_in_root(path, sizeof path, "/dev");
  if (mount("tmpfs", path, "tmpfs", MS_NOSUID | MS_NOEXEC, "mode=755,size=64k") < 0)
    die("mount /dev");
  for (size_t i = 0; i < sizeof nodes / sizeof *nodes; i++) {
    snprintf(path, sizeof path, "%s/dev/%s", root_dir, nodes[i]);
    snprintf(src, sizeof src, "/dev/%s", nodes[i]);
    int fd = open(path, O_CREAT | O_WRONLY | O_CLOEXEC, 0666);
    if (fd < 0) die("create %s", path);
    close(fd);
    if (mount(src, path, NULL, MS_BIND, NULL) < 0) die("bind %s", src);
  }
  static const char *links[][2] = {{"/proc/self/fd", "fd"},     {"/proc/self/fd/0", "stdin"},
                                   {"/proc/self/fd/1", "stdout"}, {"/proc/self/fd/2", "stderr"},
                                   {"pts/ptmx", "ptmx"}};
  for (size_t i = 0; i < sizeof links / sizeof *links; i++) {
    snprintf(path, sizeof path, "%s/dev/%s", root_dir, links[i][1]);
    if (symlink(links[i][0], path) < 0) die("symlink %s", path);
  }
  snprintf(path, sizeof path, "%s/dev/pts", root_dir);
  mkdir(path, 0755);
  /* A private devpts instance so the sandbox sees only its own terminals; optional. */
  mount("devpts", path, "devpts", MS_NOSUID | MS_NOEXEC, "newinstance,ptmxmode=0666,mode=620");
  snprintf(path, sizeof path, "%s/dev/shm", root_dir);
  mkdir(path, 01777);
  char opts[64];
  snprintf(opts, sizeof opts, "mode=1777,size=%dm", shm_mb);
  if (mount("tmpfs", path, "tmpfs", MS_NOSUID | MS_NODEV, opts) < 0) die("mount /dev/shm");
}

static void setup_root(void) {
  char path[4096];
  if (mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL) < 0) die("make / private");
  for (int i = 0; i < n_binds; i++) {
    char spec[4096];
    snprintf(spec, sizeof spec, "%s", binds[i]);
    char *colon = strchr(spec, ':');
    if (!colon) {
      errno = EINVAL;
      die("bad --bind %s", binds[i]);
    }
    *colon = 0;
    bind_ro(spec, colon + 1);
  }
  path_in_root(path, sizeof path, "/proc");
  /* hidepid=2: commands see only their own processes, not init (root) and its arguments. */
  if (mount("proc", path, "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, "hidepid=2") < 0) die("mount /proc");
  if (has_dev_nodes()) {
    /* The image carries its /dev (the host base does): only a private devpts is needed. */
    path_in_root(path, sizeof path, "/dev/pts");
    mount("devpts", path, "devpts", MS_NOSUID | MS_NOEXEC, "newinstance,ptmxmode=0666,mode=620");
  } else {
    make_dev();
  }
  if (sethostname(hostname, strlen(hostname)) < 0) die("sethostname");
  if (chdir(root_dir) < 0) die("chdir %s", root_dir);
  /* pivot_root(".", ".") stacks the old root on top of the new one; detaching it leaves the
   * sandbox with no path back to the host's tree. */
  if (syscall(SYS_pivot_root, ".", ".") < 0) die("pivot_root");
  if (umount2(".", MNT_DETACH) < 0) die("detach old root");
  if (chdir("/") < 0) die("chdir /");
  /* The root may be a slave of the host's overlay mount: cut all propagation now. */
  if (mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL) < 0) die("make new root private");
}

/* ---- commands: init forks each one and reports its exit on the request's connection ---- */

static int read_full(int fd, void *buf, size_t n) {
  size_t got = 0;
  while (got < n) {
    ssize_t r = read(fd, (char *)buf + got, n - got);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return -1;
    got += r;
  }
  return 0;
}

static void reply(int conn, const char *fmt, ...) {
  char msg[1024];
  va_list ap;
  va_start(ap, fmt);
  int n = vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  if (n > (int)sizeof msg - 1) n = sizeof msg - 1;
  send(conn, msg, n, MSG_NOSIGNAL);
}

#define MAX_RUNNING 4096
static struct {
  int conn;
  pid_t pid; /* negative once killed: the exit is still awaited */
} running[MAX_RUNNING];
static int n_running;

/* ---- the shepherd: between init and a command ---- */

/* Stop, then kill, every process below us (children, their children, ...), found in one pass
 * over /proc: stopped first, so that none forks while the others are killed (a fork bomb
 * outran kills of the children alone). Returns how many. */
#define MAX_SCAN 65536
#define PID_LIMIT (1 << 22) /* the kernel's pid_max at most */
static int kill_descendants(pid_t self) {
  static pid_t pids[MAX_SCAN], ppids[MAX_SCAN];
  static char below[MAX_SCAN], pid_below[PID_LIMIT]; /* by index; by pid */
  int n = 0;
  DIR *d = opendir("/proc");
  if (!d) return 0;
  struct dirent *e;
  while ((e = readdir(d)) && n < MAX_SCAN) {
    char *end;
    long pid = strtol(e->d_name, &end, 10);
    if (*end || pid <= 0) continue;
    char path[64], stat[512];
    snprintf(path, sizeof path, "/proc/%ld/stat", pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) continue;
    ssize_t r = read(fd, stat, sizeof stat - 1);
    close(fd);
    if (r <= 0) continue;
    stat[r] = 0;
    char *paren = strrchr(stat, ')'); /* "pid (comm) state ppid ...": comm may hold anything */
    int ppid;
    char state;
    if (paren && sscanf(paren + 1, " %c %d", &state, &ppid) == 2) {
      pids[n] = (pid_t)pid;
      ppids[n] = (pid_t)ppid;
      below[n] = ppid == self;
      n++;
    }
  }
  closedir(d);
  for (int i = 0; i < n; i++)
    if (below[i] && pids[i] < PID_LIMIT) pid_below[pids[i]] = 1;
  for (int changed = 1; changed;) { /* below: the parent is us or below us (a pass a level) */
    changed = 0;
    for (int i = 0; i < n; i++)
      if (!below[i] && ppids[i] > 0 && ppids[i] < PID_LIMIT && pid_below[ppids[i]]) {
        below[i] = changed = 1;
        if (pids[i] < PID_LIMIT) pid_below[pids[i]] = 1;
      }
  }
  for (int i = 0; i < n; i++) /* (cleared for the next pass) */
    if (pids[i] < PID_LIMIT) pid_below[pids[i]] = 0;
  int found = 0;
  for (int i = 0; i < n; i++)
    if (below[i]) {
      kill(pids[i], SIGSTOP);
      found++;
    }
  for (int i = 0; i < n; i++)
    if (below[i]) kill(pids[i], SIGKILL);
  return found;
}

/* Kill the command and every process it left behind: a process killed hands us its children,
 * so kill and reap until we have no child. Ahead of the command's processes for the CPU. */
static void end_all(void) {
  pid_t self = getpid();
  setpriority(PRIO_PROCESS, 0, -20);
  for (;;) {
    int n = kill_descendants(self);
    int st;
    pid_t w = waitpid(-1, &st, n ? 0 : WNOHANG);
    while (w > 0) w = waitpid(-1, &st, WNOHANG);
    if (w < 0 && errno == ECHILD) return;
  }
}

/* Wait for the command `cmd` (reaping what it orphans meanwhile), then exit as it did; on
 * SIGTERM from init (a kill request), end it and everything it started first. */
static void shepherd(pid_t cmd) __attribute__((noreturn));
static void shepherd(pid_t cmd) {
  /* A kill request (SIGTERM) and a child's end (SIGCHLD) are taken as they come, blocked and
   * waited for, never by a handler: a kill cannot fall between a check and a wait. Both have
   * been blocked since init (forks inherit it), so none came too early either. */
  sigset_t wait_for, term, none;
  sigemptyset(&wait_for);
  sigaddset(&wait_for, SIGTERM);
  sigaddset(&wait_for, SIGCHLD);
  sigprocmask(SIG_SETMASK, &wait_for, NULL);
  sigemptyset(&term);
  sigaddset(&term, SIGTERM);
  sigemptyset(&none);
  if (syscall(SYS_close_range, 0U, ~0U, 0U) < 0) /* no fd of init's or of the command's */
    for (int fd = 0; fd < 4096; fd++) close(fd);
  int st = 0, ended = 0;
  while (!ended) {
    int s;
    pid_t w;
    while ((w = waitpid(-1, &s, WNOHANG)) > 0) /* the command, or what it orphaned */
      if (w == cmd) {
        st = s;
        ended = 1;
      }
    if (ended || (w < 0 && errno == ECHILD)) break;
    if (sigwaitinfo(&wait_for, NULL) == SIGTERM) {
      end_all();
      raise(SIGKILL); /* reported as a kill */
    }
  }
  struct timespec now = {0, 0}; /* a kill request as the command ended: it is still a kill */
  if (sigtimedwait(&term, NULL, &now) == SIGTERM) {
    end_all();
    raise(SIGKILL);
  }
  if (WIFSIGNALED(st)) { /* end as the command did (its core, if any, is dumped already) */
    prctl(PR_SET_DUMPABLE, 0, 0, 0, 0);
    signal(WTERMSIG(st), SIG_DFL);
    sigprocmask(SIG_SETMASK, &none, NULL);
    raise(WTERMSIG(st));
  }
  _exit(WIFEXITED(st) ? WEXITSTATUS(st) : 1);
}

/* Read one request from `conn`, start the command, send its pipes; returns its pid or -1. */
static pid_t start_command(int conn) {
  struct timeval tv = {5, 0}; /* the host writes the request at once; never hang init */
  setsockopt(conn, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  uint32_t len;
  if (read_full(conn, &len, 4) < 0 || len == 0 || len > MAX_REQUEST) return -1;
  char *buf = malloc(len + 1);
  char **f = calloc(len + 2, sizeof *f);
  char **envp = NULL, **args = NULL;
  pid_t pid = -1;
  if (!buf || !f || read_full(conn, buf, len) < 0) goto out;
  buf[len] = 0;
  int nf = 0, i = 0;
  for (char *p = buf; p < buf + len; p += strlen(p) + 1) f[nf++] = p;
  const char *cwd = nf > 0 ? f[i++] : "/";
  int argc = nf > 1 ? atoi(f[i++]) : 0;
  if (argc < 1 || i + argc > nf) {
    reply(conn, "E malformed request: argc");
    goto out;
  }
  args = calloc(argc + 1, sizeof *args);
  if (!args) goto out;
  memcpy(args, f + i, argc * sizeof *args);
  i += argc;
  int envc = i < nf ? atoi(f[i]) : 0;
  if (envc < 0 || i + 1 + envc > nf) {
    reply(conn, "E malformed request: envc");
    goto out;
  }
  envp = calloc(envc + 1, sizeof *envp);
  if (!envp) goto out;
  if (envc) memcpy(envp, f + i + 1, envc * sizeof *envp);

  int in[2], out[2], err[2];
  if (pipe2(in, O_CLOEXEC) < 0 || pipe2(out, O_CLOEXEC) < 0 || pipe2(err, O_CLOEXEC) < 0) {
    reply(conn, "E pipe: %s", strerror(errno));
    goto out;
  }
  pid = fork();
  if (pid < 0) {
    reply(conn, "E fork: %s", strerror(errno));
  } else if (pid == 0) {
    setsid();
    /* the shepherd adopts what the command orphans, from the first fork on */
    prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0);
    pid_t cmd = fork();
    if (cmd < 0) {
      dprintf(err[1], "sandbox: fork: %s\n", strerror(errno));
      _exit(126);
    }
    if (cmd > 0) shepherd(cmd);
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, NULL);
    signal(SIGPIPE, SIG_DFL);
    signal(SIGTERM, SIG_DFL);
    /* Commands are the OOM killer's first choice (in the sandbox's memory cgroup and on the
     * host): a memory bomb kills itself, not init. Raising the score needs no privilege. */
    int oom = open("/proc/self/oom_score_adj", O_WRONLY | O_CLOEXEC);
    if (oom >= 0) {
      if (write(oom, "1000", 4) < 0) { /* best effort */
      }
      close(oom);
    }
    dup2(in[0], 0);
    dup2(out[1], 1);
    dup2(err[1], 2);
    struct rlimit files = {nofile, nofile}; /* (raised past init's own while still root) */
    if (setrlimit(RLIMIT_NOFILE, &files) < 0) {
      dprintf(2, "sandbox: cannot set the open files limit to %lu: %s\n",
              (unsigned long)nofile, strerror(errno));
      _exit(126);
    }
    if (setgroups(0, NULL) < 0 || setgid(run_gid) < 0 || setuid(run_uid) < 0) {
      dprintf(2, "sandbox: cannot drop privileges: %s\n", strerror(errno));
      _exit(126);
    }
    if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) < 0 || install_seccomp() < 0) {
      dprintf(2, "sandbox: cannot restrict system calls: %s\n", strerror(errno));
      _exit(126);
    }
    umask(022);
    if (chdir(cwd) < 0) {
      dprintf(2, "sandbox: cwd %s: %s\n", cwd, strerror(errno));
      _exit(126);
    }
    environ = envp;
    execvp(args[0], args);
    dprintf(2, "sandbox: %s: %s\n", args[0], strerror(errno));
    _exit(errno == ENOENT ? 127 : 126);
  } else {
    char msg[64];
    int n = snprintf(msg, sizeof msg, "F %d", (int)pid);
    int fds[3] = {in[1], out[0], err[0]};
    char cbuf[CMSG_SPACE(sizeof fds)];
    memset(cbuf, 0, sizeof cbuf);
    struct iovec iov = {msg, (size_t)n};
    struct msghdr mh = {0};
    mh.msg_iov = &iov;
    mh.msg_iovlen = 1;
    mh.msg_control = cbuf;
    mh.msg_controllen = sizeof cbuf;
    struct cmsghdr *c = CMSG_FIRSTHDR(&mh);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof fds);
    memcpy(CMSG_DATA(c), fds, sizeof fds);
    if (sendmsg(conn, &mh, MSG_NOSIGNAL) < 0) kill(pid, SIGTERM); /* its shepherd ends all */
  }
  close(in[0]);
  close(in[1]);
  close(out[0]);
  close(out[1]);
  close(err[0]);
  close(err[1]);
out:
  free(envp);
  free(args);
  free(buf);
  free(f);
  return pid;
}

/* One process serves every command (no helper process per exec): poll the listening socket,
 * a signalfd for SIGCHLD and each running command's connection (a byte or EOF = kill it). */
static void serve(void) {
  sigset_t mask;
  sigemptyset(&mask);
  sigaddset(&mask, SIGCHLD);
  sigprocmask(SIG_BLOCK, &mask, NULL);
  sigset_t term; /* blocked here, so a shepherd is never ended by one before its handler is in */
  sigemptyset(&term);
  sigaddset(&term, SIGTERM);
  sigprocmask(SIG_BLOCK, &term, NULL);
  int sfd = signalfd(-1, &mask, SFD_CLOEXEC | SFD_NONBLOCK);
  if (sfd < 0) _exit(1);
  fcntl(sock_fd, F_SETFD, FD_CLOEXEC);
  static struct pollfd pf[MAX_RUNNING + 2];
  for (;;) {
    pf[0] = (struct pollfd){sock_fd, POLLIN, 0};
    pf[1] = (struct pollfd){sfd, POLLIN, 0};
    for (int k = 0; k < n_running; k++)
      pf[k + 2] = (struct pollfd){running[k].pid > 0 ? running[k].conn : -1, POLLIN, 0};
    int nfds = n_running + 2;
    if (poll(pf, nfds, -1) < 0) continue;
    /* Kill requests first (indices still match pf). */
    for (int k = 0; k < n_running; k++) {
      if (running[k].pid > 0 && (pf[k + 2].revents & (POLLIN | POLLHUP | POLLERR))) {
        char b;
        recv(running[k].conn, &b, 1, MSG_DONTWAIT);
        kill(running[k].pid, SIGTERM); /* its shepherd ends the command and all it started */
        running[k].pid = -running[k].pid;
      }
    }
    if (pf[1].revents & POLLIN) {
      struct signalfd_siginfo si;
      while (read(sfd, &si, sizeof si) > 0) {
      }
      int st;
      pid_t w;
      while ((w = waitpid(-1, &st, WNOHANG)) > 0) {
        for (int k = 0; k < n_running; k++) {
          if (running[k].pid == w || running[k].pid == -w) {
            reply(running[k].conn, "X %d", st);
            close(running[k].conn);
            running[k] = running[--n_running];
            break;
          }
        }
      }
    }
    if ((pf[0].revents & POLLIN) && n_running < MAX_RUNNING) {
      int conn = accept4(sock_fd, NULL, NULL, SOCK_CLOEXEC);
      if (conn < 0) continue;
      /* The socket's abstract name is in the host's network namespace, where any user may
       * connect to it: only the user who started the sandbox is served. */
      struct ucred peer;
      socklen_t len = sizeof peer;
      if (getsockopt(conn, SOL_SOCKET, SO_PEERCRED, &peer, &len) < 0 || peer.uid != owner_uid) {
        close(conn);
        continue;
      }
      pid_t pid = start_command(conn);
      if (pid > 0) {
        running[n_running].conn = conn;
        running[n_running].pid = pid;
        n_running++;
      } else {
        close(conn);
      }
    }
  }
}

/* ---- init (pid 1 of the sandbox) ---- */

/* Pre-started ("pooled") mode: the namespaces, cgroups and processes exist before the sandbox's
 * filesystem does. Our copy of the sandbox directory (a shared bind mount on the host) stays a
 * slave of the host's, so the overlay the host mounts there later appears here; "G <bind>..."
 * on stdin says it is in place. */
/* A mount point as /proc/self/mountinfo writes it, made a path again in place: a space, tab,
 * newline or backslash in it is an octal escape there (\040 \011 \012 \134). */
static void unescape_mount_point(char *s) {
  char *out = s;
  for (; *s; s++, out++) {
    if (s[0] == '\\' && s[1] >= '0' && s[1] <= '7' && s[2] >= '0' && s[2] <= '7' &&
        s[3] >= '0' && s[3] <= '7') {
      *out = (char)((s[1] - '0') * 64 + (s[2] - '0') * 8 + (s[3] - '0'));
      s += 3;
    } else {
      *out = *s;
    }
  }
  *out = 0;
}

static void detach_siblings(void) {
  /* Copies of the other sandboxes' mounts would receive every later mount event of theirs
   * (each costing the host a propagation): drop all but our own directory's. */
  char own[4096], parent[4096], line[8192];
  snprintf(own, sizeof own, "%s", root_dir);
  char *slash = strrchr(own, '/');
  if (!slash) return;
  *slash = 0; /* own = <store>/sandboxes/<id> */
  snprintf(parent, sizeof parent, "%s", own);
  slash = strrchr(parent, '/');
  if (!slash) return;
  slash[1] = 0; /* parent = <store>/sandboxes/ */
  size_t np = strlen(parent), no = strlen(own);
  char *targets[4096];
  int nt = 0;
  FILE *f = fopen("/proc/self/mountinfo", "re");
  if (!f) return;
  while (fgets(line, sizeof line, f) && nt < 4096) {
    char mp[4096];
    if (sscanf(line, "%*s %*s %*s %*s %4095s", mp) != 1) continue;
    unescape_mount_point(mp);
    if (strncmp(mp, parent, np) != 0) continue;
    if (strncmp(mp, own, no) == 0 && (mp[no] == 0 || mp[no] == '/')) continue;
    targets[nt++] = strdup(mp);
  }
  fclose(f);
  for (int i = nt - 1; i >= 0; i--) umount2(targets[i], MNT_DETACH);
}

static void wait_for_go(void) {
  static char line[8192];
  /* Slave first: an unmount in a peer copy would propagate back and unmount the host's. */
  if (mount(NULL, "/", NULL, MS_REC | MS_SLAVE, NULL) < 0) die("make / slave");
  detach_siblings();
  dprintf(1, "W\n");
  size_t n = 0;
  for (;;) {
    ssize_t r = read(0, line + n, sizeof line - 1 - n);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) _exit(0); /* the pool was drained: nothing to do */
    n += r;
    if (memchr(line, '\n', n) || n >= sizeof line - 1) break;
  }
  line[n] = 0;
  char *nl = strchr(line, '\n');
  if (nl) *nl = 0;
  if (line[0] != 'G') {
    errno = EINVAL;
    die("expected G, got %.40s", line);
  }
  char *tok = strtok(line + 1, " ");
  if (tok) nofile = (rlim_t)strtoul(tok, NULL, 10);
  for (tok = strtok(NULL, " "); tok; tok = strtok(NULL, " "))
    if (n_binds < MAX_BINDS) binds[n_binds++] = tok;
}

static void init_main(void) {
  if (wait_go) wait_for_go();
  setup_root();
  dprintf(1, "R\n");
  int devnull = open("/dev/null", O_RDWR);
  dup2(devnull, 0);
  dup2(devnull, 1);
  dup2(devnull, 2);
  if (devnull > 2) close(devnull);
  signal(SIGPIPE, SIG_IGN);
  serve();
}

int main(int argc, char **argv) {
  owner_uid = getuid();
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i];
    const char *v = i + 1 < argc ? argv[i + 1] : NULL;
    if (!v) {
      errno = EINVAL;
      die("missing value for %s", a);
    }
    i++;
    if (!strcmp(a, "--root")) root_dir = v;
    else if (!strcmp(a, "--sock-fd")) sock_fd = atoi(v);
    else if (!strcmp(a, "--uid")) run_uid = (uid_t)atoi(v);
    else if (!strcmp(a, "--gid")) run_gid = (gid_t)atoi(v);
    else if (!strcmp(a, "--hostname")) hostname = v;
    else if (!strcmp(a, "--shm-mb")) shm_mb = atoi(v);
    else if (!strcmp(a, "--nofile")) nofile = (rlim_t)strtoul(v, NULL, 10);
    else if (!strcmp(a, "--wait-go")) wait_go = atoi(v);
    else if (!strcmp(a, "--netns-new")) netns_file = v, netns_new = 1;
    else if (!strcmp(a, "--netns-join")) netns_file = v, netns_new = 0;
    else if (!strcmp(a, "--bind") && n_binds < MAX_BINDS) binds[n_binds++] = v;
    else if (!strcmp(a, "--cgroup") && n_cgroups < MAX_CGROUPS) cgroups[n_cgroups++] = v;
    else {
      errno = EINVAL;
      die("unknown option %s", a);
    }
  }
  if (!root_dir || sock_fd < 0 || !netns_file) {
    errno = EINVAL;
    die("--root, --sock-fd and --netns-new/--netns-join are required");
  }
  char pid[32];
  snprintf(pid, sizeof pid, "%d", (int)getpid());
  for (int i = 0; i < n_cgroups; i++) write_file(cgroups[i], pid);
  if (netns_new) {
    if (unshare(CLONE_NEWNET) < 0) die("unshare net");
    lo_up();
    /* Bind the namespace to a file so it outlives this process (restore reuses it). */
    if (mount("/proc/self/ns/net", netns_file, NULL, MS_BIND, NULL) < 0) die("bind netns");
  } else {
    int fd = open(netns_file, O_RDONLY | O_CLOEXEC);
    if (fd < 0 || setns(fd, CLONE_NEWNET) < 0) die("join netns %s", netns_file);
    close(fd);
  }
  if (unshare(CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS) < 0) die("unshare");
  pid_t child = fork();
  if (child < 0) die("fork");
  if (child == 0) {
    init_main();
    _exit(0);
  }
  close(sock_fd);
  dprintf(1, "P %d\n", (int)child);
  close(1);
  int st;
  while (waitpid(child, &st, 0) < 0 && errno == EINTR) {
  }
  return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
}
