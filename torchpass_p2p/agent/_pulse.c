/* Pulse responder: a native thread that answers authenticated UDP pulse pings.
 *
 * Why native: a member's asyncio loop may be blocked for seconds by a thread holding the GIL
 * (scenario S01); a Python responder would then fall silent and look dead. This thread never
 * takes the GIL and never touches a Python object, so it answers while the process is merely
 * busy, and stops answering only when the process is stopped (SIGSTOP, cgroup freeze), dead or
 * cut off. The wire format is documented, and mirrored, in pulse_wire.py.
 *
 * ping, 45 bytes: "TPp2" | key id (1) | target member (8, big-endian) | nonce (16)
 *                 | HMAC-SHA256(key, first 29 bytes)[:16]
 *                 nonce = prober's member id (8, big-endian) | sequence (8, big-endian)
 * pong, 45 bytes: "TPq2" | key id (1) | nonce (16) | member (8, big-endian)
 *                 | HMAC-SHA256(key, first 29 bytes)[:16]
 *
 * A ping names the member it is for, under its tag: a responder answers only its own, so a
 * ping captured on the way to one member and relayed to others is answered by none of them.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include <openssl/crypto.h>
#include <openssl/opensslv.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>

#define KEY_BYTES 32
#define KEY_IDS 256
#define MAGIC_BYTES 4
#define NONCE_BYTES 16
#define TAG_BYTES 16
#define MEMBER_BYTES 8
#define PING_BYTES (MAGIC_BYTES + 1 + MEMBER_BYTES + NONCE_BYTES + TAG_BYTES) /* 45 */
#define PONG_BYTES (MAGIC_BYTES + 1 + NONCE_BYTES + MEMBER_BYTES + TAG_BYTES) /* 45 */
/* Datagrams read per poll wake-up: under a flood, stop() is still seen after at most this many. */
#define BATCH 64
/* Probers whose last sequence is remembered (a member has at most K = 10 observers; a slot is
 * found among PROBES neighbours of its hash, else the first of them is taken over). */
#define PROBERS 256
#define PROBES 8

/* Version 2 (the ping names its target); version 1's 37-byte pings are dropped as malformed,
 * and a version 1 prober drops version 2 pongs: the two never half-understand each other. */
static const unsigned char PING_MAGIC[MAGIC_BYTES] = {'T', 'P', 'p', '2'};
static const unsigned char PONG_MAGIC[MAGIC_BYTES] = {'T', 'P', 'q', '2'};

enum { ANSWERED, MALFORMED, UNKNOWN_KEY, MISDIRECTED, BAD_TAG, REPLAYED, SEND_ERRORS,
       RECEIVE_ERRORS, NCOUNTS };
static const char *const COUNT_NAMES[NCOUNTS] = {
    "answered", "malformed", "unknown_key", "misdirected", "bad_tag", "replayed", "send_errors",
    "receive_errors",
};

typedef struct {
    uint64_t prober, seq; /* seq 0: empty (probers count from 1) */
} Seen;

typedef struct Responder {
    PyObject_HEAD
    /* Written under the GIL before the thread starts, read-only while it runs. */
    int fd;
    int wake[2]; /* self-pipe: stop() writes, the thread's poll wakes */
    uint64_t member;
    unsigned char have[KEY_IDS];
    unsigned char keys[KEY_IDS][KEY_BYTES];
    pthread_t thread;
    pid_t owner; /* after fork() the child has no thread to join */
    int initialized;
    int joinable;            /* a started thread not yet joined; under lock */
    int running;             /* __atomic; cleared when the thread exits */
    pthread_mutex_t lock;    /* serializes stop() callers (held with the GIL released) */
    uint64_t counts[NCOUNTS]; /* __atomic, relaxed: statistics only */
    Seen seen[PROBERS];      /* the serving thread's own: the last sequence of each prober */
    struct Responder *prev, *next; /* in `running_list` while registered; under list_lock */
    int listed;
} Responder;

/* Every started responder, so that exit() can stop them before libcrypto frees its state: its
 * cleanup (atexit or a library destructor) runs at process exit while Python's finalization
 * leaves this thread running, and a ping answered then crashed in EVP_MAC_fetch on a freed
 * lock (seen in a script that never stopped its agent). */
static pthread_mutex_t list_lock = PTHREAD_MUTEX_INITIALIZER;
static Responder *running_list = NULL;

static void list_add(Responder *self) {
    pthread_mutex_lock(&list_lock);
    self->prev = NULL;
    self->next = running_list;
    if (running_list != NULL)
        running_list->prev = self;
    running_list = self;
    self->listed = 1;
    pthread_mutex_unlock(&list_lock);
}

static void list_remove(Responder *self) {
    pthread_mutex_lock(&list_lock);
    if (self->listed) {
        if (self->prev != NULL)
            self->prev->next = self->next;
        else
            running_list = self->next;
        if (self->next != NULL)
            self->next->prev = self->prev;
        self->prev = self->next = NULL;
        self->listed = 0;
    }
    pthread_mutex_unlock(&list_lock);
}

static void bump(Responder *self, int which) {
    __atomic_fetch_add(&self->counts[which], 1, __ATOMIC_RELAXED);
}

/* HMAC-SHA256(key, data)[:16] into tag; 0 on failure (OpenSSL out of memory). */
static int tag16(const unsigned char *key, const unsigned char *data, size_t n,
                 unsigned char tag[TAG_BYTES]) {
    unsigned char md[EVP_MAX_MD_SIZE];
    unsigned int md_len = 0;
    if (HMAC(EVP_sha256(), key, KEY_BYTES, data, n, md, &md_len) == NULL || md_len < TAG_BYTES)
        return 0;
    memcpy(tag, md, TAG_BYTES);
    OPENSSL_cleanse(md, sizeof md);
    return 1;
}

static uint64_t be64(const unsigned char *p) {
    uint64_t v = 0;
    for (int i = 0; i < 8; i++)
        v = (v << 8) | p[i];
    return v;
}

/* The slot of `prober` in the table of last sequences, or NULL; `home` gets where to look. */
static Seen *find_prober(Responder *self, uint64_t prober, size_t *home) {
    *home = (size_t)((prober * 0x9E3779B97F4A7C15ULL) >> 56) % PROBERS;
    for (int i = 0; i < PROBES; i++) {
        Seen *slot = &self->seen[(*home + i) % PROBERS];
        if (slot->seq != 0 && slot->prober == prober)
            return slot;
    }
    return NULL;
}

/* 0 for a replay: a sequence not above the last one its prober sent (or 0). Checked before
 * the tag, so that a flood of a captured ping costs a lookup, not an HMAC, and is never
 * answered (no reflection): an old sequence is refused whether or not its tag is good. */
static int fresh(Responder *self, const unsigned char *nonce) {
    size_t home;
    uint64_t seq = be64(nonce + 8);
    Seen *slot = find_prober(self, be64(nonce), &home);
    return seq != 0 && (slot == NULL || seq > slot->seq);
}

/* After the tag verified: the nonce's sequence is its prober's last. */
static void remember(Responder *self, const unsigned char *nonce) {
    size_t home;
    uint64_t prober = be64(nonce);
    Seen *slot = find_prober(self, prober, &home);
    for (int i = 0; slot == NULL && i < PROBES; i++) {
        Seen *candidate = &self->seen[(home + i) % PROBERS];
        if (candidate->seq == 0)
            slot = candidate;
    }
    if (slot == NULL)
        slot = &self->seen[home]; /* full around home: take over its first slot */
    slot->prober = prober;
    slot->seq = be64(nonce + 8);
}

/* Checks one datagram; answers it if it is a valid ping, else counts why it was dropped. */
static void answer(Responder *self, const unsigned char *ping, ssize_t n,
                   const struct sockaddr_storage *peer, socklen_t peer_len) {
    unsigned char tag[TAG_BYTES], pong[PONG_BYTES];
    if (n != PING_BYTES || memcmp(ping, PING_MAGIC, MAGIC_BYTES) != 0) {
        bump(self, MALFORMED);
        return;
    }
    unsigned kid = ping[MAGIC_BYTES];
    if (!self->have[kid]) {
        bump(self, UNKNOWN_KEY);
        return;
    }
    const unsigned char *key = self->keys[kid];
    /* Another member's ping (relayed, or sent to a stale address) is never answered: checked
     * before the tag, like the sequence, so dropping it costs a compare, not an HMAC. A
     * forged target gains nothing: the tag covers it. */
    if (be64(ping + MAGIC_BYTES + 1) != self->member) {
        bump(self, MISDIRECTED);
        return;
    }
    const unsigned char *nonce = ping + MAGIC_BYTES + 1 + MEMBER_BYTES;
    if (!fresh(self, nonce)) {
        bump(self, REPLAYED);
        return;
    }
    size_t signed_bytes = PING_BYTES - TAG_BYTES;
    if (!tag16(key, ping, signed_bytes, tag)
        || CRYPTO_memcmp(tag, ping + signed_bytes, TAG_BYTES) != 0) {
        bump(self, BAD_TAG);
        return;
    }
    remember(self, nonce);
    memcpy(pong, PONG_MAGIC, MAGIC_BYTES);
    pong[MAGIC_BYTES] = (unsigned char)kid;
    memcpy(pong + MAGIC_BYTES + 1, nonce, NONCE_BYTES);
    for (int i = 0; i < MEMBER_BYTES; i++)
        pong[MAGIC_BYTES + 1 + NONCE_BYTES + i] = (unsigned char)(self->member >> (56 - 8 * i));
    if (!tag16(key, pong, PONG_BYTES - TAG_BYTES, pong + PONG_BYTES - TAG_BYTES)) {
        bump(self, SEND_ERRORS);
        return;
    }
    if (sendto(self->fd, pong, PONG_BYTES, MSG_DONTWAIT, (const struct sockaddr *)peer,
               peer_len) == PONG_BYTES)
        bump(self, ANSWERED);
    else
        bump(self, SEND_ERRORS);
}

static void serve_loop(Responder *self) {
    /* One byte more than a ping: a longer datagram is truncated to PING_BYTES + 1 and rejected. */
    unsigned char buf[PING_BYTES + 1];
    for (;;) {
        struct pollfd fds[2] = {{self->fd, POLLIN, 0}, {self->wake[0], POLLIN, 0}};
        if (poll(fds, 2, -1) < 0) {
            if (errno == EINTR)
                continue;
            bump(self, RECEIVE_ERRORS);
            return;
        }
        if (fds[1].revents)
            return;
        if (fds[0].revents & POLLNVAL) { /* the caller closed the socket under us */
            bump(self, RECEIVE_ERRORS);
            return;
        }
        for (int i = 0; i < BATCH; i++) {
            struct sockaddr_storage peer;
            socklen_t peer_len = sizeof peer;
            ssize_t n = recvfrom(self->fd, buf, sizeof buf, MSG_DONTWAIT,
                                 (struct sockaddr *)&peer, &peer_len);
            if (n < 0) {
                if (errno == EAGAIN || errno == EWOULDBLOCK)
                    break;
                if (errno != EINTR)
                    bump(self, RECEIVE_ERRORS); /* e.g. a queued ICMP error: consumed, go on */
                continue;
            }
            answer(self, buf, n, &peer, peer_len);
        }
    }
}

static void *serve(void *arg) {
    Responder *self = arg;
    serve_loop(self);
    __atomic_store_n(&self->running, 0, __ATOMIC_RELEASE);
    return NULL;
}

static PyObject *Responder_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    Responder *self = (Responder *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    self->fd = self->wake[0] = self->wake[1] = -1;
    if (pthread_mutex_init(&self->lock, NULL) != 0) {
        Py_DECREF(self);
        return PyErr_NoMemory();
    }
    return (PyObject *)self;
}

/* Copies the keys into self; 0 with an exception set on a bad mapping. */
static int load_keys(Responder *self, PyObject *keys) {
    if (!PyDict_Check(keys)) {
        PyErr_SetString(PyExc_TypeError, "keys must be a dict[int, bytes]");
        return 0;
    }
    if (PyDict_GET_SIZE(keys) == 0) {
        PyErr_SetString(PyExc_ValueError, "keys must hold at least one key");
        return 0;
    }
    PyObject *kid, *secret;
    Py_ssize_t pos = 0;
    while (PyDict_Next(keys, &pos, &kid, &secret)) {
        if (!PyLong_Check(kid) || PyBool_Check(kid)) {
            PyErr_SetString(PyExc_TypeError, "key ids must be int");
            return 0;
        }
        int overflow = 0;
        long id = PyLong_AsLongAndOverflow(kid, &overflow);
        if (overflow || id < 0 || id >= KEY_IDS) {
            PyErr_SetString(PyExc_ValueError, "key ids must be in 0..255");
            return 0;
        }
        if (!PyBytes_Check(secret)) {
            PyErr_Format(PyExc_TypeError, "key %ld must be bytes", id);
            return 0;
        }
        if (PyBytes_GET_SIZE(secret) != KEY_BYTES) {
            PyErr_Format(PyExc_ValueError, "key %ld must be %d bytes, not %zd", id, KEY_BYTES,
                         PyBytes_GET_SIZE(secret));
            return 0;
        }
        memcpy(self->keys[id], PyBytes_AS_STRING(secret), KEY_BYTES);
        self->have[id] = 1;
    }
    return 1;
}

/* 1 if fd is an open IPv4 or IPv6 datagram socket; 0 with ValueError or OSError set. */
static int check_socket(int fd) {
    int type = 0, domain = 0;
    socklen_t len = sizeof type;
    if (fd < 0) {
        PyErr_SetString(PyExc_ValueError, "fd must be a non-negative file descriptor");
        return 0;
    }
    if (getsockopt(fd, SOL_SOCKET, SO_TYPE, &type, &len) != 0) {
        PyErr_SetFromErrno(errno == ENOTSOCK ? PyExc_ValueError : PyExc_OSError);
        return 0;
    }
    len = sizeof domain;
    if (getsockopt(fd, SOL_SOCKET, SO_DOMAIN, &domain, &len) != 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        return 0;
    }
    if (type != SOCK_DGRAM || (domain != AF_INET && domain != AF_INET6)) {
        PyErr_SetString(PyExc_ValueError, "fd must be an IPv4 or IPv6 UDP socket");
        return 0;
    }
    return 1;
}

static int Responder_init(Responder *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"fd", "member", "keys", NULL};
    int fd;
    PyObject *member, *keys;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "iOO:Responder", kwlist, &fd, &member, &keys))
        return -1;
    if (self->initialized) {
        PyErr_SetString(PyExc_RuntimeError, "Responder is already initialized");
        return -1;
    }
    if (!PyLong_Check(member) || PyBool_Check(member)) {
        PyErr_SetString(PyExc_TypeError, "member must be int");
        return -1;
    }
    self->member = PyLong_AsUnsignedLongLong(member);
    if (PyErr_Occurred()) {
        PyErr_SetString(PyExc_OverflowError, "member must be in 0..2**64-1");
        return -1;
    }
    if (!check_socket(fd) || !load_keys(self, keys)) {
        OPENSSL_cleanse(self->keys, sizeof self->keys);
        memset(self->have, 0, sizeof self->have);
        return -1;
    }
    self->fd = fd;
    if (pipe(self->wake) != 0) {
        self->wake[0] = self->wake[1] = -1;
        OPENSSL_cleanse(self->keys, sizeof self->keys);
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    for (int i = 0; i < 2; i++) /* CLOEXEC: a child process must not inherit the pipe */
        (void)fcntl(self->wake[i], F_SETFD, FD_CLOEXEC);
    (void)fcntl(self->wake[1], F_SETFL, O_NONBLOCK);
    /* Signals stay with Python's main thread: block them all in the new thread. */
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, &old);
    __atomic_store_n(&self->running, 1, __ATOMIC_RELEASE);
    int err = pthread_create(&self->thread, NULL, serve, self);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (err != 0) {
        close(self->wake[0]);
        close(self->wake[1]);
        self->wake[0] = self->wake[1] = -1;
        OPENSSL_cleanse(self->keys, sizeof self->keys);
        __atomic_store_n(&self->running, 0, __ATOMIC_RELEASE);
        errno = err;
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    self->owner = getpid();
    self->initialized = self->joinable = 1;
    list_add(self);
    return 0;
}

/* Wakes and joins the thread, closes the pipe, zeroes the keys. Idempotent; no GIL needed. */
static void stop_thread(Responder *self) {
    list_remove(self);
    pthread_mutex_lock(&self->lock);
    if (self->joinable) {
        if (getpid() == self->owner) {
            ssize_t w;
            do
                w = write(self->wake[1], "x", 1);
            while (w < 0 && errno == EINTR);
            pthread_join(self->thread, NULL);
        }
        close(self->wake[0]);
        close(self->wake[1]);
        self->wake[0] = self->wake[1] = -1;
        OPENSSL_cleanse(self->keys, sizeof self->keys);
        memset(self->have, 0, sizeof self->have);
        self->joinable = 0;
        __atomic_store_n(&self->running, 0, __ATOMIC_RELEASE);
    }
    pthread_mutex_unlock(&self->lock);
}

static PyObject *Responder_stop(Responder *self, PyObject *unused) {
    Py_BEGIN_ALLOW_THREADS
    stop_thread(self);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *Responder_counts(Responder *self, PyObject *unused) {
    PyObject *out = PyDict_New();
    if (out == NULL)
        return NULL;
    for (int i = 0; i < NCOUNTS; i++) {
        PyObject *v = PyLong_FromUnsignedLongLong(
            __atomic_load_n(&self->counts[i], __ATOMIC_RELAXED));
        if (v == NULL || PyDict_SetItemString(out, COUNT_NAMES[i], v) != 0) {
            Py_XDECREF(v);
            Py_DECREF(out);
            return NULL;
        }
        Py_DECREF(v);
    }
    return out;
}

static PyObject *Responder_running(Responder *self, void *closure) {
    int on = __atomic_load_n(&self->running, __ATOMIC_ACQUIRE);
    return PyBool_FromLong(on && getpid() == self->owner); /* a fork's child has no thread */
}

static void Responder_dealloc(Responder *self) {
    /* The thread never takes the GIL, so joining it while holding the GIL cannot deadlock. */
    stop_thread(self);
    pthread_mutex_destroy(&self->lock);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMethodDef Responder_methods[] = {
    {"stop", (PyCFunction)Responder_stop, METH_NOARGS,
     "stop()\n--\n\nWake and join the thread, zero the keys. Idempotent. Does not close fd."},
    {"counts", (PyCFunction)Responder_counts, METH_NOARGS,
     "counts()\n--\n\nDatagram counts by outcome (dict[str, int]): answered, malformed,\n"
     "unknown_key, misdirected, bad_tag, replayed, send_errors, receive_errors."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Responder_getset[] = {
    {"running", (getter)Responder_running, NULL,
     "Whether the thread serves: started, not stopped, its socket not closed (bool).", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject ResponderType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "torchpass_p2p.agent._pulse.Responder",
    .tp_doc = "Responder(fd, member, keys)\n--\n\n"
              "Answer pulse pings on the bound UDP socket fd from a native thread.\n\n"
              "fd: an IPv4 or IPv6 UDP socket, owned by the caller, which must keep it open\n"
              "until stop() returns. member: 0..2**64-1. keys: {key id 0..255: 32-byte secret},\n"
              "at least one. Raises TypeError, ValueError or OverflowError on bad arguments,\n"
              "OSError if the thread cannot start.",
    .tp_basicsize = sizeof(Responder),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = Responder_new,
    .tp_init = (initproc)Responder_init,
    .tp_dealloc = (destructor)Responder_dealloc,
    .tp_methods = Responder_methods,
    .tp_getset = Responder_getset,
};

static struct PyModuleDef pulse_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "torchpass_p2p.agent._pulse",
    .m_doc = "Native pulse responder; see torchpass_p2p.agent.pulse_wire.",
    .m_size = -1,
};

/* At exit(), after Python's finalization: stop every responder still running. */
static void stop_all_at_exit(void) {
    for (;;) {
        pthread_mutex_lock(&list_lock);
        Responder *self = running_list;
        pthread_mutex_unlock(&list_lock);
        if (self == NULL)
            return;
        stop_thread(self); /* unlists it */
    }
}

PyMODINIT_FUNC PyInit__pulse(void) {
    /* libcrypto registers its cleanup when first initialized; initializing it now, before our
     * handler is registered, makes ours run first (atexit handlers run in reverse order). */
    if (!OPENSSL_init_crypto(0, NULL) || atexit(stop_all_at_exit) != 0) {
        PyErr_SetString(PyExc_ImportError, "cannot initialize libcrypto or register at exit");
        return NULL;
    }
    if (PyType_Ready(&ResponderType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&pulse_module);
    if (m == NULL)
        return NULL;
    if (PyModule_AddObjectRef(m, "Responder", (PyObject *)&ResponderType) < 0
        || PyModule_AddIntConstant(m, "PING_BYTES", PING_BYTES) < 0
        || PyModule_AddIntConstant(m, "PONG_BYTES", PONG_BYTES) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
