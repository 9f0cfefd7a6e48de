import java.io.BufferedReader;
import java.io.IOException;
import java.io.InputStreamReader;
import java.util.ArrayList;
import java.util.Arrays;
import java.util.List;

import org.apache.kafka.common.utils.internals.Exit;
import org.apache.kafka.tools.AclCommand;

/**
 * Kafka's own AclCommand, run once per input line in one JVM (`scripts/stack.sh acl-repl
 * --secure`): a JVM start per ACL change cost the security tests about 9 s and 5 CPU-seconds
 * each on two busy cores.
 *
 * Each input line holds one command's arguments, tab-separated, after the ones this program was
 * started with (the node's address and admin credentials). After each command it prints the
 * command's output, then a line "\u0001postal-acl-done CODE" (0: done). A `--remove` always runs
 * with `--force` (its confirmation prompt would read this program's input).
 */
public class AclRepl {
    static final class ExitCalled extends RuntimeException {
        final int code;

        ExitCalled(int code) {
            super("exit " + code);
            this.code = code;
        }
    }

    public static void main(String[] base) throws IOException {
        Exit.setExitProcedure((code, message) -> {
            throw new ExitCalled(code);
        });
        BufferedReader in = new BufferedReader(new InputStreamReader(System.in));
        String line;
        while ((line = in.readLine()) != null) {
            List<String> args = new ArrayList<>(Arrays.asList(base));
            if (!line.isEmpty()) {
                args.addAll(Arrays.asList(line.split("\t")));
            }
            if (args.contains("--remove") && !args.contains("--force")) {
                args.add("--force");
            }
            int code = 0;
            try {
                AclCommand.main(args.toArray(new String[0]));
            } catch (ExitCalled e) {
                code = e.code;
            } catch (Throwable t) {
                t.printStackTrace(System.out);
                code = 1;
            }
            System.out.println("\u0001postal-acl-done " + code);
            System.out.flush();
        }
    }
}
