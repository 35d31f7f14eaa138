"""The local broker's ``sasl_ssl`` mode (``broker.security``; docs/how-to/security.md): a CA and a broker
certificate made with the JDK's keytool, SCRAM-SHA-512 users salted at format time (no password on
a command line) and kept in line at every start, the listener and authorizer properties, and the
check that a data dir keeps the mode and admin password it was formatted with.

A mixin of ``rlstream.broker.LocalBroker`` (which holds ``cfg``, ``data_dir``, ``tls_dir``,
``ca_file``, ``formatfile``). Not a certificate authority for anything but this dev broker.
"""

from __future__ import annotations

import base64
import hashlib
import ipaddress
import json
import os
import secrets
import shutil
import subprocess
from pathlib import Path

from pipeline.errors import BrokerError, KafkaClientError
from rlstream.kafka_tools import java_client_properties

SCRAM_MECHANISM = "SCRAM-SHA-512"
SCRAM_ITERATIONS = 8192
TLS_VALIDITY_DAYS = 3650


class BrokerSecurity:
    def _security_properties(self) -> dict[str, str]:
        """SASL_SSL client listener (SCRAM-SHA-512, TLS), SASL/PLAIN controller listener, ACLs."""
        admin_pw = self.cfg.users["admin"]
        store_pw = (self.tls_dir / "password").read_text().strip()
        scram = (
            f'org.apache.kafka.common.security.scram.ScramLoginModule required username="admin" password="{admin_pw}";'
        )
        plain = (
            "org.apache.kafka.common.security.plain.PlainLoginModule required "
            f'username="admin" password="{admin_pw}" user_admin="{admin_pw}";'
        )
        return {
            "listener.security.protocol.map": "SASL_SSL:SASL_SSL,CONTROLLER:SASL_PLAINTEXT",
            # Clients and the broker itself (inter-broker, e.g. transaction markers): SCRAM over TLS.
            "sasl.enabled.mechanisms": SCRAM_MECHANISM,
            "sasl.mechanism.inter.broker.protocol": SCRAM_MECHANISM,
            f"listener.name.sasl_ssl.{SCRAM_MECHANISM.lower()}.sasl.jaas.config": scram,
            "ssl.keystore.type": "PKCS12",
            "ssl.keystore.location": str(self.tls_dir / "broker.p12"),
            "ssl.keystore.password": store_pw,
            "ssl.key.password": store_pw,
            "ssl.truststore.type": "PEM",  # the broker as a client of itself trusts the local CA
            "ssl.truststore.location": str(self.ca_file),
            "ssl.client.auth": "none",
            "ssl.endpoint.identification.algorithm": "https",
            # The controller: SCRAM cannot authenticate it (its credentials live in the metadata it
            # serves), and PLAINTEXT would make User:ANONYMOUS a super user: PLAIN, admin only.
            "sasl.mechanism.controller.protocol": "PLAIN",
            "listener.name.controller.sasl.enabled.mechanisms": "PLAIN",
            "listener.name.controller.plain.sasl.jaas.config": plain,
            "authorizer.class.name": "org.apache.kafka.metadata.authorizer.StandardAuthorizer",
            "allow.everyone.if.no.acl.found": "false",
            "super.users": "User:admin",
        }

    def _sans(self) -> str:
        """Subject alternative names of the broker certificate: 127.0.0.1, localhost and ``host``."""
        names = ["IP:127.0.0.1", "DNS:localhost"]
        host = self.cfg.host
        try:
            entry = f"IP:{ipaddress.ip_address(host)}"
        except ValueError:
            entry = f"DNS:{host}"
        if entry not in names and host not in ("0.0.0.0", "::"):
            names.append(entry)
        return ",".join(names)

    def _ensure_tls(self, progress) -> None:
        """A CA and a broker certificate it signed (SANs from ``_sans``), made once with the JDK's
        keytool: ``tls/ca.pem`` (the CA, PEM), ``tls/broker.p12`` (key + chain, PKCS12),
        ``tls/password`` (the keystores' random password). Remade if the SANs changed."""
        d, sans = self.tls_dir, self._sans()
        files = [d / "password", d / "broker.p12", self.ca_file, d / "sans.txt"]
        if all(f.is_file() for f in files) and (d / "sans.txt").read_text() == sans:
            return
        keytool = shutil.which("keytool") or str(Path(shutil.which("java")).resolve().parent / "keytool")
        if not Path(keytool).is_file():
            raise BrokerError(
                "keytool (part of the JDK/JRE) not found: the sasl_ssl broker makes its certificate with it"
            )
        progress(f"generating a CA and the broker's TLS certificate in {d} ({sans})")
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(mode=0o700, parents=True)
        pw = secrets.token_urlsafe(24)
        (d / "password").touch(mode=0o600)
        (d / "password").write_text(pw)
        env = {**os.environ, "RLSTREAM_STOREPASS": pw}
        days = str(TLS_VALIDITY_DAYS)
        key = "-keyalg EC -groupname secp256r1 -storetype PKCS12 -storepass:env RLSTREAM_STOREPASS".split()

        def keytool_run(*args: str) -> None:
            r = subprocess.run([keytool, *args], capture_output=True, text=True, env=env, cwd=d)
            if r.returncode != 0:
                raise BrokerError(f"keytool {args[0]} failed:\n{(r.stdout + r.stderr)[-2000:]}")

        ca, broker = ["-keystore", "ca.p12", *key], ["-keystore", "broker.p12", *key]
        keytool_run("-genkeypair", *ca, "-alias", "ca", "-dname", "CN=rlstream local broker CA", "-validity", days,
                    "-ext", "BasicConstraints:critical=ca:true", "-ext", "KeyUsage:critical=keyCertSign,cRLSign")  # fmt: skip
        keytool_run("-exportcert", "-rfc", *ca, "-alias", "ca", "-file", "ca.pem")
        keytool_run("-genkeypair", *broker, "-alias", "broker", "-dname", "CN=localhost", "-validity", days)
        keytool_run("-certreq", *broker, "-alias", "broker", "-file", "broker.csr")
        keytool_run("-gencert", "-rfc", *ca, "-alias", "ca", "-infile", "broker.csr", "-outfile", "broker.crt",
                    "-validity", days, "-ext", f"SubjectAlternativeName={sans}",
                    "-ext", "KeyUsage:critical=digitalSignature", "-ext", "ExtendedKeyUsage=serverAuth,clientAuth")  # fmt: skip
        keytool_run("-importcert", "-noprompt", *broker, "-alias", "ca", "-file", "ca.pem")
        keytool_run("-importcert", *broker, "-alias", "broker", "-file", "broker.crt")
        (d / "broker.csr").unlink()
        (d / "sans.txt").write_text(sans)

    def _scram_args(self) -> list[str]:
        """StorageTool ``--add-scram`` arguments: salted passwords (PBKDF2-HMAC-SHA512, as Kafka's
        ScramFormatter computes them), so no password appears on a command line."""
        out = []
        for name, password in sorted(self.cfg.users.items()):
            salt = secrets.token_bytes(32)
            salted = hashlib.pbkdf2_hmac("sha512", password.encode(), salt, SCRAM_ITERATIONS)
            b64 = base64.b64encode
            out += ["--add-scram", f"{SCRAM_MECHANISM}=[name={name},iterations={SCRAM_ITERATIONS},"
                    f"salt={b64(salt).decode()},saltedpassword={b64(salted).decode()}]"]  # fmt: skip
        return out

    def _admin_verifier(self, salt: bytes) -> str:
        return base64.b64encode(
            hashlib.pbkdf2_hmac("sha512", self.cfg.users["admin"].encode(), salt, SCRAM_ITERATIONS)
        ).decode()

    def _write_format_record(self) -> None:
        """``security.json``: the mode and users the storage was formatted with, and a salted hash
        of admin's password (the SCRAM salted password Kafka itself stores), to catch a changed one."""
        rec: dict = {"security": self.cfg.security, "users": sorted(self.cfg.users)}
        if self.secured:
            salt = secrets.token_bytes(32)
            rec.update(admin_salt=base64.b64encode(salt).decode(), admin_verifier=self._admin_verifier(salt))
        self.formatfile.write_text(json.dumps(rec, indent=2))
        self.formatfile.chmod(0o600)

    def _check_format(self) -> None:
        """The data dir keeps the security mode it was formatted with (no admin credential exists in
        a plaintext one; a secured one's ACLs would be silently ignored), and admin's password."""
        try:
            rec = json.loads(self.formatfile.read_text())
        except (OSError, ValueError):
            rec = {}  # formatted before security modes existed: plaintext
        formatted = rec.get("security", "plaintext")
        if formatted != self.cfg.security:
            raise BrokerError(
                f"{self.data_dir} was formatted for broker.security = {formatted!r}, not {self.cfg.security!r}; "
                "use another broker.data_dir (or delete this one) to change it"
            )
        if self.secured and "admin_salt" in rec:
            if self._admin_verifier(base64.b64decode(rec["admin_salt"])) != rec.get("admin_verifier"):
                raise BrokerError(
                    f"broker.users.admin is not the password {self.data_dir} was formatted with; the admin "
                    "password cannot change (the broker authenticates to itself with it): restore it, or use "
                    "a fresh broker.data_dir"
                )

    def _write_admin_properties(self) -> Path:
        """Java client properties of the admin user, for Kafka's own tools (``--command-config``)."""
        f = self.data_dir / "admin-client.properties"
        f.touch(mode=0o600)
        f.write_text(java_client_properties(self.client_conf("admin")))
        return f

    def _sync_users(self, port: int, pid: int) -> None:
        """Create users added to ``broker.users`` since the format, and apply changed passwords."""
        from pipeline.admin import Admin

        others = {u: pw for u, pw in self.cfg.users.items() if u != "admin"}
        admin = Admin({"bootstrap.servers": f"{self.cfg.host}:{port}", **self.client_conf("admin")}, timeout=30)
        try:
            admin.upsert_scram_users(others, SCRAM_MECHANISM, SCRAM_ITERATIONS)
        except KafkaClientError as exc:
            self._kill(pid)
            self.pidfile.unlink(missing_ok=True)
            raise BrokerError(f"could not set the SCRAM users {sorted(others)}: {exc}") from exc
        finally:
            admin.close()
